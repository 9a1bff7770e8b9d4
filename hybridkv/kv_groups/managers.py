"""Per-kind managers: what each layer kind frees early and which prefix-cache hits it accepts.

One manager per distinct spec. The plan may split one spec's layers into several pool groups (each
group fills whole pool pages); those groups share every decision (same block size, same skip rule, same
token counts), so a manager drives all of them at once over a (G_spec, rows, cols) slice of the block
tables. Kind semantics (docs/design.md, "Semantics"), for ``n`` computed tokens and block size ``bs``:

================  ============================  =================================================
kind              leading blocks freed          a prefix hit at length L (multiple of bs) needs
================  ============================  =================================================
full              0                             blocks 0 .. L/bs - 1 cached
sliding window W  max(0, n - W + 1) // bs       the cdiv(W - 1, bs) blocks before L cached
chunked local C   (n // C) * C // bs            the blocks from the chunk start (L // C) * C to L
mamba             (state overwritten in place)  a checkpoint stored exactly at L
================  ============================  =================================================

Every manager has one interface (``GroupManager``), so the coordinator iterates over its managers with no
kind switch: which prefix-cache hits the kind accepts (``find_longest_cache_hit``, ``take_cache_hit``), what
it holds per request row and frees (``free_row``, ``reset_rows``, ``swap_rows``), and hooks through a
request's life that a kind may ignore (arrival, prompt and final lengths, ``can_allocate`` /
``allocate_rows``, ``commit``, ``take_state_copies``). Attention managers decide which leading blocks to free
(``skipped_blocks``, ``remove_skipped_blocks``); what every attention kind does alike -- a new block for every
``block_size`` new tokens, registering full blocks under their keys -- the coordinator does once over the
stacked (G, R, C) block tables of all attention groups. The state manager (``StateManager``: Mamba, short
convolution, Gated DeltaNet and KDA states, one slot per request for all of them) keeps its working slots,
its prefix-cache checkpoints and their copy queue inside it. The hooks are vectorised over request rows so
a batch step costs a few numpy ops per spec, not a Python call per request; ``skipped_blocks_to_free`` is the
dry run the coordinator uses to check memory for all groups before changing anything.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from hybridkv.kv_groups.block_pool import NULL_BLOCK, NULL_SLOT, BlockPool, CheckpointKind, StateSlotPool
from hybridkv.kv_groups.block_table import token_ranges
from hybridkv.kv_groups.hashing import BlockHash
from hybridkv.kv_groups.sharing import SharedPrefixIndex
from hybridkv.kv_groups.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridkv.utils import cdiv

logger = logging.getLogger("hybridkv.kv_groups")
_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True, kw_only=True)
class SkippedBlocks:
    """Blocks a batch may free now: rows that change, their new skip count, and the (G, k) block ids at
    entries (rows_rep[k], cols[k]) in each of the manager's groups."""

    rows: np.ndarray          # (r,) rows whose skip count grows
    new_skip: np.ndarray      # (r,)
    rows_rep: np.ndarray      # (k,) row of each freed entry
    cols: np.ndarray          # (k,) column of each freed entry
    block_ids: np.ndarray     # (G, k)


class GroupManager(ABC):
    """What the coordinator asks of every kind, for the groups of one spec. ``rows`` are request rows (the
    coordinator's; the same in every manager), vectorised where a step calls them."""

    kind: ClassVar[str]
    spec: KVCacheSpec
    block_size: int
    group_ids: tuple[int, ...]
    frees_early: ClassVar[bool] = False        # frees leading blocks while the request runs (attention)
    cache_cap: np.ndarray | None = None        # (R,) hash blocks per row worth registering (None: all)

    # -- prefix hits ---------------------------------------------------------------------------------------
    def cached_mask(self, block_hashes: Sequence[BlockHash], *, entries: np.ndarray | None = None
                    ) -> np.ndarray | None:
        """(n,) bool: block j of the chain is cached for this kind; None when the kind keeps no blocks."""
        return None

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int, *,
                               cached: np.ndarray | None = None) -> int:
        """Largest L <= ``max_length`` this kind accepts as a prefix hit (0: none); ``cached`` is
        ``cached_mask(block_hashes)`` when the caller already has it."""

    @abstractmethod
    def take_cache_hit(self, row: int, block_hashes: Sequence[BlockHash], length: int) -> None:
        """Take for ``row`` what a hit at ``length`` needs."""

    # -- a request's life (hooks a kind may ignore) ---------------------------------------------------------
    def waiting(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:  # noqa: B027 (optional hook)
        """The request arrived and waits, its prompt's block keys ``block_hashes`` (prefix caching on)."""

    def admitted(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """The waiting request looked up its prefix hit (what it took replaces what was kept for it)."""

    def finished(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """The request finished or was aborted: nothing is kept for it any more."""

    def arrived(self, row: int, request_id: str) -> None:  # noqa: B027 (optional hook)
        """The request took ``row``."""

    def set_prompt(self, row: int, num_prompt_tokens: int, num_computed: int) -> None:  # noqa: B027 (optional hook)
        """The row's prompt length is known."""

    def set_final(self, row: int, final_length: int, num_computed: int) -> None:  # noqa: B027 (optional hook)
        """The row's request ends at ``final_length`` tokens unless it stops earlier."""

    def can_allocate(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` (about to run) can get what this kind gives a running row beyond blocks."""
        return True

    def allocate_rows(self, rows: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """Give it to them (after ``can_allocate`` said yes for every manager)."""

    def commit(self, rows: np.ndarray, num_computed: np.ndarray, *,  # noqa: B027 (optional hook)
               chain: Callable[[int, int], list[BlockHash]],
               prompt_chain: Callable[[int], Sequence[BlockHash] | None], sharing: SharedPrefixIndex) -> None:
        """A step computed ``rows`` up to ``num_computed`` (prefix caching on): ``chain(row, n)`` is the row's
        first n block keys, ``prompt_chain(row)`` its prompt's keys as the shared-prefix index holds them."""

    def take_state_copies(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(src, dst) slot copies to apply before the next forward (the queue is emptied); None: none kept."""
        return None

    def holds(self, row: int) -> bool:
        """Whether ``row`` holds anything of this kind beyond its block-table entries."""
        return False

    @abstractmethod
    def free_row(self, row: int, num_cols: int) -> None:
        """Release everything ``row`` holds (``num_cols``: its block-table entries)."""

    @abstractmethod
    def reset_rows(self, rows: np.ndarray | int) -> None:
        """Forget ``rows``' per-row state (they were released)."""

    @abstractmethod
    def swap_rows(self, a: int, b: int) -> None:
        """Swap the per-row state of rows ``a`` and ``b``."""

    @abstractmethod
    def usage(self) -> dict[int, float]:
        """Per group id: the fraction of its memory in use (its blocks of the shared pool, or working slots)."""

    def check_invariants(self) -> None:  # noqa: B027 (optional hook)
        """Raise AssertionError where the manager's own state is inconsistent."""


class AttentionManager(GroupManager):
    """Blocks of one attention spec across its pool groups. ``tables`` is the (G, R, C) slice of the
    block tables that holds those groups; ``num_skipped[row]`` counts leading entries already freed and
    ``next_free[row]`` is the num_computed at which the next one becomes free (so a batch step finds
    the few rows with something to free in one comparison)."""

    kind: ClassVar[str]

    def __init__(self, spec: AttentionSpec, *, group_ids: Sequence[int], pool: BlockPool,
                 tables: np.ndarray) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.group_ids = tuple(group_ids)
        self.pool = pool
        self.tables = tables                                           # (G, R, C) view
        self.num_skipped = np.zeros(tables.shape[1], np.int32)         # (R,)
        self.next_free = np.zeros(tables.shape[1], np.int64)           # (R,)

    frees_early: ClassVar[bool] = True

    @abstractmethod
    def skipped_blocks(self, num_computed: np.ndarray) -> np.ndarray:
        """(r,) leading blocks whose tokens are all skipped once ``num_computed`` (r,) are done."""

    @abstractmethod
    def next_free_at(self, num_skipped: np.ndarray) -> np.ndarray:
        """(r,) smallest num_computed whose ``skipped_blocks`` exceeds ``num_skipped`` (r,)."""

    @abstractmethod
    def hit_start_block(self, length: int) -> int:
        """First block a prefix hit at ``length`` must hold (blocks before it are skipped)."""

    def reset_rows(self, rows: np.ndarray | int, num_skipped: int = 0) -> None:
        self.num_skipped[rows] = num_skipped
        self.next_free[rows] = self.next_free_at(np.atleast_1d(np.int64(num_skipped)))[0]

    def swap_rows(self, a: int, b: int) -> None:
        for arr in (self.num_skipped, self.next_free):
            arr[[a, b]] = arr[[b, a]]

    def usage(self) -> dict[int, float]:
        live = self.pool.live_blocks_per_group()       # (for stats: O(num_blocks))
        return {gid: float(live[gid]) / (self.pool.num_blocks - 1) for gid in self.group_ids}

    # -- freeing ---------------------------------------------------------------------------------
    def _skipped(self, rows: np.ndarray, num_computed: np.ndarray, assume_due: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """(rows that move, their new skip count, rows_rep, cols) or None. Only rows with
        ``num_computed >= next_free`` can free anything, so most rows cost one comparison
        (``assume_due``: the caller already kept only those rows)."""
        if not assume_due:
            due = num_computed >= self.next_free[rows]
            n_due = np.count_nonzero(due)
            if n_due == 0:
                return None
            if n_due != due.size:
                rows, num_computed = rows[due], num_computed[due]
        # next_free is exact, so every due row frees >= 1 block; and num_computed <= the allocated
        # tokens, so skipped blocks never reach past the row's entries.
        target = self.skipped_blocks(num_computed)
        cur = self.num_skipped[rows]
        grow = target - cur
        if np.add.reduce(grow) == grow.size:          # one block per row (decode)
            return rows, target, rows, cur
        owner, cols = token_ranges(cur.astype(np.int64), grow)
        return rows, target, rows[owner], cols

    def skipped_blocks_to_free(self, rows: np.ndarray, num_computed: np.ndarray, *,
                               assume_due: bool = False) -> SkippedBlocks | None:
        """What ``remove_skipped_blocks`` would free (no state change); None when nothing."""
        found = self._skipped(rows, num_computed, assume_due)
        if found is None:
            return None
        rows, target, rows_rep, cols = found
        return SkippedBlocks(rows=rows, new_skip=target, rows_rep=rows_rep, cols=cols,
                             block_ids=self.tables[:, rows_rep, cols])

    def apply_free(self, skipped: SkippedBlocks) -> None:
        self._free(skipped.rows, skipped.new_skip, skipped.rows_rep, skipped.cols, skipped.block_ids)

    def _free(self, rows: np.ndarray, new_skip: np.ndarray, rows_rep: np.ndarray, cols: np.ndarray,
              block_ids: np.ndarray) -> None:
        self.tables[:, rows_rep, cols] = NULL_BLOCK
        self.num_skipped[rows] = new_skip
        self.next_free[rows] = self.next_free_at(new_skip)
        self.pool.free(block_ids.reshape(-1))

    def remove_skipped_blocks(self, rows: np.ndarray, num_computed: np.ndarray, *,
                              assume_due: bool = False) -> None:
        """Free blocks whose tokens are all skipped; their entries become the null block."""
        found = self._skipped(rows, num_computed, assume_due)
        if found is not None:
            rows, target, rows_rep, cols = found
            self._free(rows, target, rows_rep, cols, self.tables[:, rows_rep, cols])

    # -- prefix cache ----------------------------------------------------------------------------
    def cached_mask(self, block_hashes: Sequence[BlockHash], *, entries: np.ndarray | None = None) -> np.ndarray:
        """(n,) bool: block j of the chain is cached in every group of this spec."""
        return self.pool.cached_mask(block_hashes, self.group_ids, entries=entries)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int, *,
                               cached: np.ndarray | None = None) -> int:
        """Largest L <= ``max_length`` (a multiple of bs) whose needed blocks are all cached; 0 if none.
        ``cached`` is ``cached_mask(block_hashes)`` when the caller already has it."""
        end = min(max_length // self.block_size, len(block_hashes))
        if cached is None:
            cached = self.cached_mask(block_hashes[:end])
        return self._longest_hit(cached[:end].tolist(), end) * self.block_size

    @abstractmethod
    def _longest_hit(self, cached: list[bool], end: int) -> int:
        """Largest accepted hit in blocks, <= ``end``, given which of blocks 0 .. end-1 are cached."""

    def take_cache_hit(self, row: int, block_hashes: Sequence[BlockHash], length: int) -> None:
        """Reference the blocks a hit at ``length`` needs and write them into ``row``."""
        start, end = self.hit_start_block(length), length // self.block_size
        if end > start:
            ids = self.pool.cached_blocks(block_hashes[start:end], self.group_ids)     # (G, end - start)
            for g, group_ids in zip(self.group_ids, ids, strict=True):
                self.pool.touch(g, group_ids)
            self.tables[:, row, start:end] = ids
        self.reset_rows(row, start)

    # -- request end -----------------------------------------------------------------------------
    def free_row(self, row: int, num_cols: int) -> None:
        """Release every block of ``row`` (last block first, per group) and clear it."""
        start = int(self.num_skipped[row])
        assert num_cols <= self.tables.shape[2], f"row {row}: {num_cols} columns, the table has {self.tables.shape[2]}"
        cols = slice(start, max(start, num_cols))
        ids = self.tables[:, row, cols].copy()                         # (G, k)
        self.tables[:, row, cols] = NULL_BLOCK
        self.reset_rows(row)
        self.pool.free(ids[:, ::-1].T.reshape(-1))     # tails of every group first

    def held_blocks(self, row: int, num_cols: int) -> np.ndarray:
        """(G, n) non-null block ids of ``row``, per group."""
        return self.tables[:, row, self.num_skipped[row]:num_cols]


class FullAttentionManager(AttentionManager):
    kind = "full"
    frees_early = False

    def skipped_blocks(self, num_computed: np.ndarray) -> np.ndarray:
        return np.zeros_like(num_computed)

    def next_free_at(self, num_skipped: np.ndarray) -> np.ndarray:
        return np.full_like(num_skipped, np.iinfo(np.int64).max, dtype=np.int64)

    def hit_start_block(self, length: int) -> int:
        return 0

    def _longest_hit(self, cached: list[bool], end: int) -> int:
        return cached.index(False) if False in cached else end


class SlidingWindowManager(AttentionManager):
    kind = "sliding_window"

    def __init__(self, spec: SlidingWindowSpec, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        self.window = spec.sliding_window
        self.blocks_needed = cdiv(self.window - 1, self.block_size)
        self.next_free[:] = self.next_free_at(self.num_skipped)

    def skipped_blocks(self, num_computed: np.ndarray) -> np.ndarray:
        return np.maximum(num_computed - (self.window - 1), 0) // self.block_size

    def next_free_at(self, num_skipped: np.ndarray) -> np.ndarray:
        # max(0, n - W + 1) // bs > s  <=>  n >= (s + 1) * bs + W - 1
        return num_skipped.astype(np.int64, copy=False) * self.block_size + (self.block_size + self.window - 1)

    def hit_start_block(self, length: int) -> int:
        return max(0, length // self.block_size - self.blocks_needed)

    def _longest_hit(self, cached: list[bool], end: int) -> int:
        # Right to left: at block j, ``run`` counts cached blocks j, j+1, ...; the first j where it
        # reaches ``need`` gives the largest hit j + need. Without any full window, only a hit covered
        # from block 0 works: the run left over at j = 0.
        need = self.blocks_needed
        if need == 0:                       # window 1: a query sees only itself
            return end
        run = 0
        for j in range(end - 1, -1, -1):
            if cached[j]:
                run += 1
                if run >= need:
                    return j + need
            else:
                run = 0
        return run


class ChunkedLocalManager(AttentionManager):
    kind = "chunked_local"

    def __init__(self, spec: ChunkedLocalAttentionSpec, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        self.chunk = spec.attention_chunk_size
        self.blocks_per_chunk = self.chunk // self.block_size
        self.next_free[:] = self.next_free_at(self.num_skipped)

    def skipped_blocks(self, num_computed: np.ndarray) -> np.ndarray:
        return (num_computed // self.chunk) * self.blocks_per_chunk

    def next_free_at(self, num_skipped: np.ndarray) -> np.ndarray:
        # (n // C) * bpc > s  <=>  n >= (s // bpc + 1) * C
        return (num_skipped.astype(np.int64) // self.blocks_per_chunk + 1) * self.chunk

    def hit_start_block(self, length: int) -> int:
        return (length // self.chunk) * self.blocks_per_chunk

    def _longest_hit(self, cached: list[bool], end: int) -> int:
        # A chunk boundary needs nothing (the next query starts a fresh chunk), so the last boundary
        # <= end is always a hit; beyond it, the run of cached blocks from that boundary.
        n = (end // self.blocks_per_chunk) * self.blocks_per_chunk
        while n < end and cached[n]:
            n += 1
        return n


class StateManager(GroupManager):
    """Working state slots and prefix-cache checkpoints for every recurrent-state group (``MambaSpec``: Mamba,
    short convolution, Gated DeltaNet, KDA; one slot holds the states of all such layers). ``block_size`` is
    the checkpoint granularity; a hit needs a checkpoint exactly at its length, and a state exists only where
    a step ends, so where checkpoints land is decided here and by the scheduler (which ends prefill chunks at
    the first three kinds):

    ==========  =====================================================================================
    SHARED      the end of a prefix that several unfinished requests share (``SharedPrefixIndex``)
    PROMPT      the prompt's last block boundary (below its length: the last token is always recomputed)
    BOUNDARY    any other block-aligned prefill chunk end (long prompts)
    ANSWER      while decoding: every ``decode_interval`` tokens and the last block boundary before the
                request's known final length (``set_final``); one per request, replaced as it advances,
                so a finished request leaves its prompt + output (the next chat turn starts there)
    ==========  =====================================================================================

    A copy costs one state's bytes (read + write); the decode checkpoints add ``1 / decode_interval`` of
    the state traffic the decode steps already have, and none are taken without prefix caching. The copies
    are queued here, composed (``queue_copy``), and applied by the runner before the next forward. Per-row
    arrays are (R,) and vectorised: a commit costs a comparison unless a row reaches a checkpoint length.
    """

    kind: ClassVar[str] = "mamba"

    def __init__(self, spec: MambaSpec, *, group_ids: Sequence[int], slots: StateSlotPool, max_num_reqs: int,
                 hash_block_size: int, decode_interval: int | None = None, checkpoints: bool = True) -> None:
        """``checkpoints``: store checkpoints (prefix caching on, and the plan has checkpoint slots)."""
        if spec.block_size % hash_block_size:
            raise ValueError(f"MambaSpec.block_size={spec.block_size} must be a multiple of the attention "
                             f"block_size={hash_block_size} so hybrid prefix hits line up")
        interval = 4 * spec.block_size if decode_interval is None else decode_interval
        if interval <= 0 or interval % spec.block_size:
            raise ValueError(f"decode_checkpoint_interval must be a positive multiple of the Mamba block size "
                             f"{spec.block_size}, got {decode_interval}")
        self.spec = spec
        self.block_size = spec.block_size
        self.hash_block_size = hash_block_size
        self.decode_interval = interval
        self.group_ids = tuple(group_ids)
        self.slots = slots
        self.checkpoints = checkpoints and slots.num_checkpoint_slots > 0
        R = max_num_reqs
        self.slot = np.zeros(R, np.int32)               # working slot per row, 0 = none
        self.pending = np.zeros(R, np.int32)            # pinned checkpoint awaiting its copy
        self.next_ckpt = np.full(R, _NEVER, np.int64)   # the next length whose commit may checkpoint
        self.prompt_ckpt = np.zeros(R, np.int64)        # the prompt's last block boundary
        self.final_ckpt = np.zeros(R, np.int64)         # last boundary before the known final length (0: none)
        self.cache_cap = np.zeros(R, np.int64)          # hash blocks up to the furthest checkpoint stored
        self.tail = np.zeros(R, np.int32)               # the row's ANSWER checkpoint slot, 0 = none
        self.since = np.zeros(R, np.int64)              # the slot pool's clock when the row's request arrived
        self._tail_key: list[BlockHash | None] = [None] * R
        self._copies: dict[int, int] = {}               # dst slot -> src slot, composed
        self._copied_hosts: list[int] = []              # host checkpoints read by the queued copies (pinned)
        self._warned = False
        self._slotless: set[int] = set()                # rows of requests without a working slot yet
        self._arrival: dict[str, int] = {}              # the slot pool's clock when a waiting request arrived
        self._wanted: dict[str, int] = {}               # the checkpoint each waiting request wants kept

    def row_arrays(self) -> list[np.ndarray]:
        """The per-row arrays (swapped with the coordinator's rows)."""
        return [self.slot, self.pending, self.next_ckpt, self.prompt_ckpt, self.final_ckpt, self.cache_cap,
                self.tail, self.since]

    def swap_rows(self, a: int, b: int) -> None:
        for arr in self.row_arrays():
            arr[[a, b]] = arr[[b, a]]
        self._tail_key[a], self._tail_key[b] = self._tail_key[b], self._tail_key[a]
        if (a in self._slotless) != (b in self._slotless):
            self._slotless ^= {a, b}

    def _settle_tail(self, row: int) -> None:
        tail = int(self.tail[row])
        if tail and self.slots.key_of(tail) == self._tail_key[row]:
            self.slots.settle(tail)

    def reset_rows(self, rows: np.ndarray | int) -> None:
        rows = np.atleast_1d(rows)
        self.next_ckpt[rows] = _NEVER
        self.prompt_ckpt[rows] = 0
        self.final_ckpt[rows] = 0
        self.cache_cap[rows] = 0
        for row in rows.tolist():
            self._settle_tail(row)
            self._tail_key[row] = None
            self._slotless.discard(row)
        self.tail[rows] = NULL_SLOT

    def usage(self) -> dict[int, float]:
        used = (self.slots.num_working_slots - self.slots.num_free_slots) / self.slots.num_working_slots
        return dict.fromkeys(self.group_ids, used)

    def holds(self, row: int) -> bool:
        return bool(self.slot[row] or self.pending[row])

    # -- waiting requests ------------------------------------------------------------------------------
    def waiting(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Note the arrival time and keep the checkpoint the request would start from now (a later store
        cannot evict it before the request is admitted)."""
        self._arrival[request_id] = self.slots.clock
        if self.checkpoints and block_hashes:
            slot = self.want(block_hashes)
            if slot != NULL_SLOT:
                self._wanted[request_id] = slot

    def admitted(self, request_id: str) -> None:
        slot = self._wanted.pop(request_id, NULL_SLOT)
        if slot != NULL_SLOT:
            self.slots.unwant(slot)

    def finished(self, request_id: str) -> None:
        self.admitted(request_id)
        self._arrival.pop(request_id, None)

    # -- where checkpoints land ----------------------------------------------------------------------
    def arrived(self, row: int, request_id: str) -> None:
        """The row's request arrived when the slot pool's clock read its arrival time (now, if it never
        waited): checkpoints nobody stored or hit since then are cold for it (any of them may make room for
        its checkpoints). It has no working slot until its first allocation."""
        self.since[row] = self._arrival.get(request_id, self.slots.clock)
        self._slotless.add(row)

    def set_prompt(self, row: int, num_prompt_tokens: int, num_computed: int) -> None:
        self.prompt_ckpt[row] = (num_prompt_tokens - 1) // self.block_size * self.block_size
        self._update_next(row, num_computed)

    def set_final(self, row: int, final_length: int, num_computed: int) -> None:
        """The request ends at ``final_length`` tokens unless it stops earlier: its last computed token is
        ``final_length - 1``, so the last checkpoint its answer can leave is the boundary below that."""
        self.final_ckpt[row] = (final_length - 1) // self.block_size * self.block_size
        self._update_next(row, num_computed)

    def _update_next(self, row: int, nc: int) -> None:
        """The next length after ``nc`` a commit may checkpoint the row at: every aligned length up to the
        prompt's last boundary (prefill chunks end aligned there), then every ``decode_interval`` and the
        final boundary. Scalar: it runs for the few rows that reached a checkpoint length in a step."""
        if not self.checkpoints:
            self.next_ckpt[row] = _NEVER
            return
        mbs, every, final = self.block_size, self.decode_interval, int(self.final_ckpt[row])
        prefill = (nc // mbs + 1) * mbs
        if prefill <= self.prompt_ckpt[row]:
            self.next_ckpt[row] = prefill
            return
        decode = (nc // every + 1) * every
        self.next_ckpt[row] = final if nc < final < decode else decode

    def commit(self, rows: np.ndarray, num_computed: np.ndarray, *,
               chain: Callable[[int, int], list[BlockHash]],
               prompt_chain: Callable[[int], Sequence[BlockHash] | None], sharing: SharedPrefixIndex) -> None:
        """After a step computed ``rows`` up to ``num_computed``: checkpoint the rows whose step ended at a
        checkpoint length (queue the copy of the working state), then move their next checkpoint length on.
        ``chain(row, n)``: the row's first n block keys; ``prompt_chain(row)``: its prompt's keys as the
        shared-prefix index holds them (None: not indexed)."""
        nc = num_computed
        due = nc >= self.next_ckpt[rows]
        if not np.count_nonzero(due):
            return
        mbs, hbs, step = self.block_size, self.hash_block_size, self.block_size // self.hash_block_size
        for row, n in zip(rows[due].tolist(), nc[due].tolist(), strict=True):     # (a few rows per step)
            self._update_next(row, n)
            if n % mbs:
                continue
            blocks = n // hbs
            replace = NULL_SLOT
            if n > self.prompt_ckpt[row]:
                kind = CheckpointKind.ANSWER
                tail = int(self.tail[row])
                if tail and self.slots.key_of(tail) == self._tail_key[row]:
                    replace = tail
            else:
                pc = prompt_chain(row)
                if pc is not None and sharing.is_stop(pc, blocks, step):
                    kind = CheckpointKind.SHARED
                else:
                    kind = CheckpointKind.PROMPT if n == self.prompt_ckpt[row] else CheckpointKind.BOUNDARY
            evicted = self.slots.num_evicted
            since = int(self.since[row])
            if self.slots.has_room(kind, replace=replace, since=since):   # (else skip hashing: it cannot stay)
                key = chain(row, blocks)[blocks - 1]
                slot, is_new = self.slots.store_checkpoint(key, kind, replace=replace, since=since,
                                                           growing=kind is CheckpointKind.ANSWER)
            else:
                slot, is_new = NULL_SLOT, False
            for dev, host in self.slots.take_demotions():     # the slot's old checkpoint moves to host memory
                self.queue_copy(dev, host)
            if is_new:
                self.queue_copy(int(self.slot[row]), slot)
            if slot != NULL_SLOT:
                self.cache_cap[row] = max(int(self.cache_cap[row]), blocks)
                if kind is CheckpointKind.ANSWER and is_new:       # (one found stored is someone else's)
                    if slot != replace:
                        self._settle_tail(row)
                    self.tail[row] = slot
                    self._tail_key[row] = key
            if not self._warned and (slot == NULL_SLOT or self.slots.num_evicted > evicted):
                self._warned = True
                logger.warning(
                    "prefix cache: all %d Mamba checkpoint slots (+ %d in host memory) are in use; from now on a "
                    "checkpoint replaces an older one of its kind or lower (least recently used first) or is "
                    "skipped, so prefix hits on Mamba layers may degrade (outputs do not); a larger "
                    "kv_cache_memory or host_cache_memory holds more",
                    self.slots.num_checkpoint_slots, self.slots.num_host_slots)

    # -- prefix hits --------------------------------------------------------------------------------
    def key_at(self, block_hashes: Sequence[BlockHash], length: int) -> BlockHash:
        return block_hashes[length // self.hash_block_size - 1]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int, *,
                               cached: np.ndarray | None = None) -> int:
        """Largest L <= ``max_length`` with a checkpoint stored exactly at L (0 = start from zero)."""
        if not self.checkpoints:
            return 0
        stored, step = self.slots.stored_keys, self.block_size // self.hash_block_size
        for j in range(max_length // self.block_size * step, 0, -step):     # in hash blocks, longest first
            if block_hashes[j - 1] in stored:
                return j * self.hash_block_size
        return 0

    def want(self, block_hashes: Sequence[BlockHash]) -> int:
        """Protect the longest checkpoint along ``block_hashes`` for a request that waits to start from it;
        returns its slot (0: none) for ``unwant``."""
        length = self.find_longest_cache_hit(block_hashes, len(block_hashes) * self.hash_block_size)
        if length == 0:
            return NULL_SLOT
        slot = self.slots.lookup_checkpoint(self.key_at(block_hashes, length))
        self.slots.want(slot)
        return slot

    def take_cache_hit(self, row: int, block_hashes: Sequence[BlockHash], length: int) -> None:
        """Pin the checkpoint at ``length`` for ``row``; its copy is queued once the row has a slot."""
        ckpt = self.slots.lookup_checkpoint(self.key_at(block_hashes, length))
        assert ckpt != NULL_SLOT
        self.slots.pin(ckpt)
        self.pending[row] = ckpt
        self.cache_cap[row] = length // self.hash_block_size

    # -- working slots and copies -------------------------------------------------------------------
    def can_allocate(self, rows: np.ndarray) -> bool:
        return not self._slotless or np.count_nonzero(self.slot[rows] == NULL_SLOT) <= self.slots.num_free_slots

    def allocate_rows(self, rows: np.ndarray) -> None:
        if self._slotless:
            need = rows[self.slot[rows] == NULL_SLOT]
            if need.size:
                self.assign_slots(need)

    def assign_slots(self, rows: np.ndarray) -> None:
        """Give ``rows`` working slots (the caller checked there are enough); a pinned hit is copied in."""
        self._slotless.difference_update(rows.tolist())
        slots = self.slots.allocate(rows.size)
        self.slot[rows] = slots
        for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
            ckpt = int(self.pending[row])
            if ckpt != NULL_SLOT:
                self.queue_copy(ckpt, slot)
                if self.slots.is_host(ckpt):
                    # kept until the copies are taken: a demotion into this host slot in the same batch would
                    # write it before the runner reads it (host copies cannot gather first, device ones do)
                    self._copied_hosts.append(ckpt)
                else:
                    self.slots.unpin(ckpt)
                self.pending[row] = NULL_SLOT

    def queue_copy(self, src: int, dst: int) -> None:
        """Compose ``dst <- src`` with the copies already queued (sequential semantics)."""
        src = self._copies.get(src, src)
        if src == dst:
            self._copies.pop(dst, None)
        else:
            self._copies[dst] = src

    def take_state_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) int64 slot arrays to apply before the next forward; the queue is emptied. Slots from
        ``slots.num_slots`` on are host-memory checkpoints."""
        for host in self._copied_hosts:
            self.slots.unpin(host)
        self._copied_hosts = []
        if not self._copies:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        dst = np.fromiter(self._copies.keys(), np.int64, len(self._copies))
        src = np.fromiter(self._copies.values(), np.int64, len(self._copies))
        self._copies = {}
        return src, dst

    def free_row(self, row: int, num_cols: int) -> None:
        self.slots.free(self.slot[row:row + 1])
        ckpt = int(self.pending[row])
        if ckpt != NULL_SLOT:
            self.slots.unpin(ckpt)
        self.slot[row] = NULL_SLOT
        self.pending[row] = NULL_SLOT

    def check_invariants(self) -> None:
        self.slots.check_invariants()
        held = self.slot[self.slot != NULL_SLOT]
        assert np.unique(held).size == held.size, "a working slot is held twice"
        assert held.size == self.slots.num_working_slots - self.slots.num_free_slots, "slot leak"
        wanted = np.bincount(np.fromiter(self._wanted.values(), np.int64, len(self._wanted)),
                             minlength=len(self.slots._wants))
        assert wanted.tolist() == self.slots._wants, "wanted checkpoints disagree with the waiting requests"
        assert all(self.slots.key_of(s) is not None for s in self._wanted.values()), "a wanted slot is free"


def make_attention_manager(spec: AttentionSpec, **kw: object) -> AttentionManager:
    """The manager class for ``spec``'s kind."""
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, **kw)  # type: ignore[arg-type]
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, **kw)  # type: ignore[arg-type]
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalManager(spec, **kw)  # type: ignore[arg-type]
    raise TypeError(f"no manager for attention spec {type(spec).__name__}")

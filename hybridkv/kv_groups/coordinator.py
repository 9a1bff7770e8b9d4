"""The KV-cache coordinator: one object that allocates for every group at once, or for none.

Each request owns one *row*, the same in every attention group's block table and in the Mamba slot
array, for its whole life (until ``free``; ``swap_rows``/``move_row`` let the engine reorder rows).
Attention groups share one block size, so they all hold the same number of logical entries per row
(``block_tables.num_blocks``); kinds differ only in which leading entries they free (null block 0).

A step, as the engine drives it::

    coord.add_waiting(rid, prompt)                  # arrival: hash the prompt, index what it shares
    coord.prefix_stops(rid)                         # where its prefill chunks should end (shared prefixes)
    L = coord.find_prefix_hit(rid, prompt)          # admission: take cached blocks / pin a checkpoint
    ok = coord.allocate(rid, num_computed_tokens=L, num_new_tokens=n, token_ids=prompt)
    ok = coord.allocate_batch(rows, num_computed, num_new)      # running requests, all or nothing
    src, dst = coord.take_state_copies()            # runner: state[dst] = state[src] before the forward
    slots = coord.block_tables.slot_mapping(token_rows, positions)   # (G, T) KV write slots
    ... forward ...
    coord.commit_batch(rows, num_computed + num_new)  # register hashes, checkpoint Mamba, free skipped
    coord.free(rid)                                   # finish, abort or preemption
    coord.forget(rid)                                 # finish or abort: it no longer shares anything

Mamba state copies are returned already composed (``dst`` distinct; each ``src`` names the content to
read *before* any copy of the batch is applied), so ``t[dst] = t[src]`` in one gather/scatter is exact
even when a slot is both a source and a destination. The runner must apply them before the next forward.
A working slot newly handed out holds stale state: the runner starts a request with
``num_computed_tokens == 0`` from a zero state (``has_initial_state = False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.kv_groups.block_pool import NULL_BLOCK, NULL_SLOT, BlockPool, StateSlotPool
from hybridkv.kv_groups.block_table import MultiGroupBlockTable, token_ranges
from hybridkv.kv_groups.hashing import BlockHash, BlockHasher, TokenSeq, TokenSource
from hybridkv.kv_groups.managers import (
    AttentionManager,
    GroupManager,
    SkippedBlocks,
    StateManager,
    make_attention_manager,
)
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.sharing import SharedPrefixIndex
from hybridkv.kv_groups.specs import AttentionSpec, MambaSpec
from hybridkv.utils import cdiv

_KIND_ORDER = {"full": 0, "chunked_local": 1, "sliding_window": 2}
_NEVER = np.iinfo(np.int64).max
# Direct ufunc reductions: ndarray.max/.sum/.any go through Python wrappers (~1 µs each on the step path).
_max, _sum, _count = np.maximum.reduce, np.add.reduce, np.count_nonzero


@dataclass(frozen=True, kw_only=True)
class PrefixCacheStats:
    """Counters since construction (or ``reset_stats``)."""

    queries: int = 0            # find_prefix_hit calls
    query_tokens: int = 0       # prompt tokens looked up
    hit_tokens: int = 0         # tokens served from the cache
    hit_requests: int = 0       # queries with a hit > 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True, kw_only=True)
class CheckpointStats:
    """Mamba prefix-cache checkpoints since construction: how full the slots are and what the traffic did."""

    slots: int                  # checkpoint slots in the plan (device)
    stored: int                 # checkpoints held now (both tiers)
    written: int                # states copied into a checkpoint
    evicted: int                # checkpoints lost to make room for newer ones
    refused: int                # checkpoints skipped: every slot was protected or of a higher kind
    host_slots: int = 0         # checkpoint slots in host memory
    host_stored: int = 0        # checkpoints held there now
    demoted: int = 0            # checkpoints moved there from a device slot
    host_busy: int = 0          # checkpoints lost instead: every copy to host memory was in flight


class KVCacheCoordinator:
    """Allocation, prefix caching and freeing for every group of ``plan``."""

    def __init__(self, plan: KVCachePlan, *, enable_prefix_caching: bool = True, max_num_reqs: int = 256,
                 hash_algorithm: str = "blake2b", hash_salt: bytes = b"", decode_checkpoint_interval: int | None = None,
                 device: torch.device | str = "cpu", share_host_memory: bool | None = None) -> None:
        if max_num_reqs <= 0:
            raise ValueError(f"max_num_reqs must be positive, got {max_num_reqs}")
        self.plan = plan
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_reqs = max_num_reqs
        self.block_size = bs = plan.block_size
        self.max_model_len = plan.max_model_len
        self.hasher = BlockHasher(block_size=bs, algorithm=hash_algorithm, salt=hash_salt)  # type: ignore[arg-type]

        # Attention: one manager per distinct spec over a contiguous slice of the block tables.
        by_spec: dict[AttentionSpec, list[int]] = {}
        for g in plan.attention_groups:
            assert isinstance(g.spec, AttentionSpec)
            by_spec.setdefault(g.spec, []).append(g.group_id)
        ordered = sorted(by_spec.items(), key=lambda kv: _KIND_ORDER[kv[0].kind])
        self.table_index: dict[int, int] = {}             # group id -> index in block_tables
        for _, gids in ordered:
            for gid in gids:
                self.table_index[gid] = len(self.table_index)
        n_attn = len(self.table_index)
        self.pool = BlockPool(max(plan.num_blocks, 2), len(plan.groups)) if n_attn else None
        self.block_tables = MultiGroupBlockTable(
            max(n_attn, 1), max_num_reqs, cdiv(plan.max_model_len, bs), block_size=bs, device=device,
            share_host_memory=share_host_memory)
        self.managers: list[AttentionManager] = []
        self._table_slices: list[slice] = []                # each manager's tables in block_tables
        start = 0
        for spec, gids in ordered:
            self._table_slices.append(slice(start, start + len(gids)))
            self.managers.append(make_attention_manager(
                spec, group_ids=gids, pool=self.pool, tables=self.block_tables.np[start:start + len(gids)]))
            start += len(gids)
        self._early = [m for m in self.managers if m.frees_early]
        # Each early-freeing manager keeps, per row, the num_computed at which the row frees its next
        # block, so one comparison per step finds the few rows with something to free.
        self._num_attn_groups = n_attn
        self._attn_group_ids = tuple(sorted(self.table_index, key=self.table_index.__getitem__))

        # Recurrent states (Mamba, short conv, GDN, KDA): one slot holds every such layer's state.
        state_groups = plan.mamba_groups
        self.slots: StateSlotPool | None = None
        self.state: StateManager | None = None
        if state_groups:
            spec = state_groups[0].spec
            assert isinstance(spec, MambaSpec)
            if any(g.spec.block_size != spec.block_size for g in state_groups):
                raise ValueError("all Mamba groups must share one block_size (checkpoint granularity)")
            self.slots = StateSlotPool(plan.num_state_slots, plan.num_checkpoint_slots,
                                       plan.num_host_checkpoint_slots)
            self.state = StateManager(spec, group_ids=[g.group_id for g in state_groups], slots=self.slots,
                                      max_num_reqs=max_num_reqs, hash_block_size=bs,
                                      decode_interval=decode_checkpoint_interval, checkpoints=enable_prefix_caching)
        # Every manager, attention first: the coordinator drives them all alike (``GroupManager``).
        self.owners: list[GroupManager] = [*self.managers, *([self.state] if self.state else [])]
        # Prompt chains of unfinished requests (from arrival to finish), for shared-prefix stops.
        self.sharing = SharedPrefixIndex()
        self._stop_step = (self.state.block_size // bs) if self.state else 1

        # Per-row state, (R,) each.
        R = max_num_reqs
        self._num_cols = self.block_tables.num_blocks               # entries held per row (all groups)
        self._num_computed = np.zeros(R, np.int64)
        self._num_cached = np.zeros(R, np.int64)                    # full blocks already registered
        self._prompt_known = np.zeros(R, np.bool_)                  # prompt length given to the managers
        # Full blocks worth registering: with Mamba layers a hit needs a state checkpoint at its length,
        # so blocks past a row's furthest checkpoint could never be part of one.
        caps = [m.cache_cap for m in self.owners if m.cache_cap is not None]     # (the state manager's, live)
        assert len(caps) <= 1
        self._cache_cap = caps[0] if caps else np.full(R, _NEVER, np.int64)
        self._hashes: list[list[BlockHash]] = [[] for _ in range(R)]
        self._tokens: list[TokenSource | None] = [None] * R            # what hashes are read from
        self._req_ids: list[str | None] = [None] * R
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(R - 1, -1, -1))
        self._stats = PrefixCacheStats()
        # Per group (plan order): lookups and the tokens each group alone would have served.
        self._group_index = {g.group_id: i for i, g in enumerate(plan.groups)}
        self._group_hits = np.zeros((len(plan.groups), 2), np.int64)      # (hit tokens, hit requests)
        self._kind_group_rows = [np.array([self._group_index[g] for g in m.group_ids]) for m in self.owners]

    # -- accessors -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks if self.pool else 0

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free_slots if self.slots else 0

    @property
    def num_requests(self) -> int:
        return len(self._rows)

    @property
    def stats(self) -> PrefixCacheStats:
        return self._stats

    def reset_stats(self) -> None:
        self._stats = PrefixCacheStats()
        self._group_hits[:] = 0

    def group_stats(self) -> dict[int, PrefixCacheStats]:
        """Per group id: the lookups (the same for every group) and the tokens of the longest prefix that
        group alone holds (its own kind's rule); the hybrid hit is the longest that all of them accept."""
        s = self._stats
        return {g.group_id: PrefixCacheStats(queries=s.queries, query_tokens=s.query_tokens,
                                             hit_tokens=int(self._group_hits[i, 0]),
                                             hit_requests=int(self._group_hits[i, 1]))
                for i, g in enumerate(self.plan.groups)}

    def checkpoint_stats(self) -> CheckpointStats | None:
        """Mamba checkpoint slots and traffic (None without Mamba layers)."""
        if self.slots is None:
            return None
        p = self.slots
        return CheckpointStats(slots=p.num_checkpoint_slots, stored=p.num_checkpoints, written=p.num_stored,
                               evicted=p.num_evicted, refused=p.num_refused, host_slots=p.num_host_slots,
                               host_stored=p.num_host_checkpoints, demoted=p.num_demoted,
                               host_busy=p.num_host_busy)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._rows

    def row_of(self, request_id: str) -> int:
        """The request's row in every block table and in ``mamba_slots`` (stable until free/move)."""
        return self._rows[request_id]

    def request_at(self, row: int) -> str | None:
        return self._req_ids[row]

    def num_computed_tokens(self, request_id: str) -> int:
        return int(self._num_computed[self._rows[request_id]])

    def num_computed_at(self, rows: np.ndarray) -> np.ndarray:
        """(B,) int64 tokens computed (as last allocated / committed) of registered ``rows`` (B,)."""
        return self._num_computed[rows]

    def block_ids(self, request_id: str, group_id: int) -> np.ndarray:
        """(n,) int32 entries of the request in an attention group (null = 0 for freed entries)."""
        row = self._rows[request_id]
        return self.block_tables.np[self.table_index[group_id], row, :self._num_cols[row]].copy()

    def step_tables(self, rows: np.ndarray, seq_lens: np.ndarray
                    ) -> tuple[list[np.ndarray], list[np.ndarray | None], int]:
        """The block tables a step reads, per attention table (``table_index`` order): (B, *) int32 rows of
        ``rows`` (B,) covering ``seq_lens`` (B,) keys, allocated for them; and the logical width
        (the most blocks a row reads). An early-freeing kind's rows start at their first live block (its
        (B,) int32 starts are returned, None for full attention): a step neither copies nor reads the
        entries of blocks already freed, which are exactly the blocks the sliding-window and
        local-attention transforms would drop."""
        bs = self.block_size
        need = (seq_lens + (bs - 1)) // bs                          # (B,) blocks each row reads
        width = int(_max(need, initial=0))
        tables: list[np.ndarray] = []
        starts: list[np.ndarray | None] = []
        for m, groups in zip(self.managers, self._table_slices, strict=True):
            if m.frees_early:
                start = m.num_skipped[rows]
                live = int(_max(need - start, initial=0))
                tables.extend(self.block_tables.row_windows(groups, rows, start, live))
                starts.extend([start] * (groups.stop - groups.start))
            else:
                tables.extend(self.block_tables.np[groups][:, rows, :width])
                starts.extend([None] * (groups.stop - groups.start))
        return tables, starts, width

    def mamba_slot(self, request_id: str) -> int:
        """The request's working state slot (0 before its first allocate, or without state groups)."""
        return int(self.state.slot[self._rows[request_id]]) if self.state else NULL_SLOT

    def state_slots(self, rows: np.ndarray) -> np.ndarray:
        """(B,) int32 working slots of ``rows`` (the recurrent kernels' state indices)."""
        return self.state.slot[rows] if self.state else np.zeros(len(rows), np.int32)

    def usage(self) -> dict[int, float]:
        """Per group: fraction of the shared block pool it holds live (attention), or of the working
        slots in use (recurrent states)."""
        out: dict[int, float] = {}
        for m in self.owners:
            out.update(m.usage())
        return dict(sorted(out.items()))

    def blocks_to_admit(self, num_tokens: int) -> int:
        """Pool blocks one running request of ``num_tokens`` holds while decoding (its steady need)."""
        return sum(len(m.group_ids) * m.spec.steady_blocks_per_request(num_tokens) for m in self.managers)

    def can_admit(self, num_tokens: int, *, num_cached_tokens: int = 0, request_id: str | None = None) -> bool:
        """Whether a new request of ``num_tokens`` (``num_cached_tokens`` of them prefix hits whose blocks
        are already live) fits next to the per-step transient reserve.

        The reserve (``plan.reserved_step_blocks``: prefill-chunk blocks that fall out of a window or a
        chunk when the step ends) is kept once for the step, not once per request (docs/design.md, "Beyond
        existing runtimes").
        ``request_id``: a request that already holds its row (after ``find_prefix_hit``) needs no new one."""
        needs_row = request_id is None or request_id not in self._rows
        if (needs_row and not self._free_rows) or (self.slots is not None and self.slots.num_free_slots < 1):
            return False
        need = self.blocks_to_admit(num_tokens) - self.blocks_to_admit(num_cached_tokens)
        return self.num_free_blocks - self.plan.reserved_step_blocks >= need

    # -- request lifecycle -----------------------------------------------------------------------
    def _add(self, request_id: str) -> int:
        if not self._free_rows:
            return -1
        row = self._free_rows.pop()
        self._rows[request_id] = row
        self._req_ids[row] = request_id
        for m in self.owners:
            m.arrived(row, request_id)
        return row

    def _release_row(self, row: int) -> None:
        rid = self._req_ids[row]
        assert rid is not None
        del self._rows[rid]
        self._req_ids[row] = None
        self._num_cols[row] = 0
        self._num_computed[row] = 0
        self._num_cached[row] = 0
        self._prompt_known[row] = False
        rows = np.array([row])
        for m in self.owners:
            m.reset_rows(rows)
        self._hashes[row] = []
        self._tokens[row] = None
        self._free_rows.append(row)

    def _holds_cache(self, row: int) -> bool:
        return bool(self._num_cols[row] > 0 or any(m.holds(row) for m in self.owners))

    # -- shared prefixes of unfinished requests ----------------------------------------------------
    def add_waiting(self, request_id: str, token_ids: TokenSeq) -> None:
        """A request arrived: hash its prompt once (``find_prefix_hit`` reuses the chain), index what it
        shares with the other unfinished requests, and keep the Mamba checkpoint it would start from now
        (a later checkpoint store cannot evict it before the request is admitted)."""
        if not self.enable_prefix_caching or request_id in self.sharing:
            return
        chain = self.hasher.chain(token_ids, (len(token_ids) - 1) // self.block_size) if len(token_ids) > 1 else []
        self.sharing.add(request_id, chain)
        for m in self.owners:
            m.waiting(request_id, chain)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: it shares nothing any more (``free`` releases its cache)."""
        for m in self.owners:
            m.finished(request_id)
        self.sharing.remove(request_id)

    def prefix_stops(self, request_id: str) -> list[tuple[int, BlockHash, int]]:
        """(length, key, sharers) of the ends of the prefixes the request shares with other unfinished
        requests, ascending, at the checkpoint granularity: a prefill chunk ending there leaves a state (a
        Mamba checkpoint) every sharer can start from. Empty for requests not indexed (``add_waiting``)."""
        chain = self.sharing.chain(request_id)
        if not chain:
            return []
        bs = self.block_size
        return [(j * bs, chain[j - 1], n) for j, n in self.sharing.stops(chain, self._stop_step)]

    def stops_generation(self, request_id: str) -> int:
        """Changes to the requests that could share a prefix with this one: ``prefix_stops`` is unchanged
        while this is (for caching it)."""
        chain = self.sharing.chain(request_id)
        return self.sharing.generation(chain) if chain else 0

    def _prompt_chain_of(self, row: int) -> Sequence[BlockHash] | None:
        rid = self._req_ids[row]
        return None if rid is None else self.sharing.chain(rid)

    def set_final_length(self, request_id: str, num_tokens: int) -> None:
        """The request ends at ``num_tokens`` tokens unless it stops earlier (max_tokens): its answer's last
        block boundary is checkpointed exactly, for the next chat turn."""
        row = self._rows[request_id]
        for m in self.owners:
            m.set_final(row, num_tokens, int(self._num_computed[row]))

    # -- prefix hits --------------------------------------------------------------------------------
    def find_prefix_hit(self, request_id: str, token_ids: TokenSeq) -> int:
        """Longest cached prefix L (a multiple of block_size, < len(token_ids)) every group accepts;
        takes its blocks (and pins the Mamba checkpoint at L) for the request, which it registers.

        Call it before the request's first ``allocate`` (or after ``free``). Returns 0 when there is no
        hit, caching is off or no row is free (then nothing is registered). If the request is then not
        scheduled, call ``free`` to release the blocks it took."""
        row = self._rows.get(request_id)
        if row is not None and self._holds_cache(row):
            raise ValueError(f"request {request_id!r} already holds cache entries; free it first")
        if row is None:
            row = self._add(request_id)
            if row < 0:
                return 0
        n = len(token_ids)
        self._tokens[row] = self.hasher.source(token_ids)
        self._set_prompt(row, n)
        s = self._stats
        self._stats = PrefixCacheStats(queries=s.queries + 1, query_tokens=s.query_tokens + n,
                                       hit_tokens=s.hit_tokens, hit_requests=s.hit_requests)
        for m in self.owners:                    # the pin of the hit taken below replaces what was kept
            m.admitted(request_id)
        if not self.enable_prefix_caching or n <= 1:
            return 0
        nb = (n - 1) // self.block_size
        indexed = self.sharing.chain(request_id)
        hashes = list(indexed[:nb]) if indexed else []
        self.hasher.extend(hashes, token_ids, nb)
        self._hashes[row] = hashes
        length = self.longest_common_hit(hashes, nb * self.block_size, record=True)
        if length == 0:
            return 0
        for m in self.owners:
            m.take_cache_hit(row, hashes, length)
        nb = length // self.block_size
        self._num_cols[row] = nb
        self._num_computed[row] = length
        self._num_cached[row] = nb
        self._set_prompt(row, n)
        s = self._stats
        self._stats = PrefixCacheStats(queries=s.queries, query_tokens=s.query_tokens,
                                       hit_tokens=s.hit_tokens + length, hit_requests=s.hit_requests + 1)
        return length

    def longest_common_hit(self, block_hashes: Sequence[BlockHash], max_length: int, *,
                           record: bool = False) -> int:
        """Fixed point of L <- each group's longest hit <= L, full attention first: the largest L that
        every group accepts (each step only shrinks L and never below that largest L). It starts from the
        smallest of the groups' own longest hits (``record``: counted in ``group_stats``)."""
        keys = block_hashes[:max_length // self.block_size]
        entries = self.pool.entries(keys) if self.pool is not None else None
        masks = [m.cached_mask(keys, entries=entries) for m in self.owners]
        own = [m.find_longest_cache_hit(block_hashes, max_length, cached=mask)
               for m, mask in zip(self.owners, masks, strict=True)]
        if record:
            for length, groups in zip(own, self._kind_group_rows, strict=True):
                self._group_hits[groups] += (length, length > 0)
        length = min(own, default=max_length)
        while True:
            before = length
            for m, mask in zip(self.owners, masks, strict=True):
                length = m.find_longest_cache_hit(block_hashes, length, cached=mask)
            if length == before:
                return length

    def allocate(self, request_id: str, *, num_computed_tokens: int, num_new_tokens: int,
                 token_ids: TokenSeq | None = None) -> bool:
        """Make room for ``num_new_tokens`` after ``num_computed_tokens`` in every group, or change
        nothing and return False (pool, slots or rows short). Frees skipped blocks first; a new request
        also gets its working state slot (and the copy of a pinned checkpoint) here."""
        row = self._rows.get(request_id)
        new = row is None
        if not new and num_computed_tokens > int(self._num_cols[row]) * self.block_size:
            raise ValueError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is beyond "
                             f"its {int(self._num_cols[row]) * self.block_size} allocated tokens")
        if new:
            if num_computed_tokens:
                raise ValueError(f"request {request_id!r} is new: num_computed_tokens must be 0, got "
                                 f"{num_computed_tokens} (prefix hits come from find_prefix_hit)")
            row = self._add(request_id)
            if row < 0:
                return False
        try:
            ok = self.allocate_batch(np.array([row]), np.array([num_computed_tokens], np.int64),
                                     np.array([num_new_tokens], np.int64))
        except ValueError:
            if new:
                self._release_row(row)
            raise
        if not ok and new:
            self._release_row(row)
        elif ok and token_ids is not None:
            self._tokens[row] = self.hasher.source(token_ids)
            if not self._prompt_known[row]:
                self._set_prompt(row, len(token_ids))
        return ok

    def allocate_batch(self, rows: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray) -> bool:
        """``allocate`` for registered, distinct ``rows`` (B,) at once: every row or none.

        Vectorised: a decode step costs a few numpy ops; only rows that cross a block boundary (or
        free a block) produce per-entry work. Trusts ``num_computed`` <= the allocated tokens of each
        row (the per-request ``allocate`` checks it)."""
        bs = self.block_size
        nc = num_computed
        end = nc + num_new
        if rows.size == 0:
            return True
        if _max(end) > self.max_model_len:
            raise ValueError(f"allocate_batch: {int(_max(end))} tokens > max_model_len={self.max_model_len}")
        cur = self._num_cols[rows]
        grow = (end + (bs - 1)) // bs - cur
        grown = grow > 0
        per_group = 0
        if _count(grown):
            g_rows, g_grow, g_cur = rows[grown], grow[grown], cur[grown]
            per_group = int(_sum(g_grow))

        frees: list[tuple[AttentionManager, SkippedBlocks]] = []
        gained = 0
        for m, m_rows, m_nc in self._due_frees(rows, nc):
            sk = m.skipped_blocks_to_free(m_rows, m_nc, assume_due=True)
            if sk is not None:
                frees.append((m, sk))
        if frees:
            assert self.pool is not None
            gained = self.pool.num_freed_by(np.concatenate([sk.block_ids.reshape(-1) for _, sk in frees]))
        if per_group * self._num_attn_groups > self.num_free_blocks + gained:
            return False
        if not all(m.can_allocate(rows) for m in self.owners):
            return False

        # -- commit: nothing below can fail --
        for m, sk in frees:
            m.apply_free(sk)
        if per_group:
            if self._num_attn_groups:
                if per_group == g_rows.size:                 # one block per row (decode)
                    rows_rep, cols = g_rows, g_cur
                else:
                    owner, cols = token_ranges(g_cur.astype(np.int64), g_grow)
                    rows_rep = g_rows[owner]
                assert self.pool is not None
                self.block_tables.np[:, rows_rep, cols] = self.pool.allocate(per_group, self._attn_group_ids)
            self._num_cols[g_rows] = g_cur + g_grow
        self._num_computed[rows] = nc
        for m in self.owners:
            m.allocate_rows(rows)
        return True

    def set_host_move_budget(self, moves: int) -> None:
        """How many recurrent-state checkpoints the stores of the next commit may move to host memory (the
        runner's copies out that have landed: ``StepRunner.host_moves_available``); past that, one a store
        evicts is lost rather than wait for a copy."""
        if self.slots is not None:
            self.slots.host_move_budget = moves

    def take_state_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) int64 slot arrays to apply before the next forward; the queue is emptied.

        Apply them as one gather + scatter, ``state[dst] = state[src]`` (all reads before any write):
        each ``src`` names a slot's content *before* the batch, so pair-by-pair copying can be wrong
        when a slot is both a source and a destination."""
        copies = [c for c in (m.take_state_copies() for m in self.owners) if c is not None]
        if len(copies) == 1:
            return copies[0]
        if not copies:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([c[0] for c in copies]), np.concatenate([c[1] for c in copies])

    def commit(self, request_id: str, *, num_computed_tokens: int, token_ids: TokenSeq | None = None) -> None:
        """After a step computed the request up to ``num_computed_tokens``: checkpoint the recurrent state where
        one is due (``StateManager``), register newly full blocks, free blocks that became skipped.

        ``token_ids`` (all tokens known so far) replaces the sequence the coordinator hashes from; a list
        the engine appends to in place can be given once, at the first allocate."""
        row = self._rows[request_id]
        if num_computed_tokens > int(self._num_cols[row]) * self.block_size:
            raise ValueError(f"request {request_id!r}: commit of {num_computed_tokens} tokens is beyond its "
                             f"{int(self._num_cols[row]) * self.block_size} allocated tokens")
        if token_ids is not None:
            self._tokens[row] = self.hasher.source(token_ids)
        self.commit_batch(np.array([row]), np.array([num_computed_tokens], np.int64))

    def commit_batch(self, rows: np.ndarray, num_computed: np.ndarray,
                     token_ids: Sequence[TokenSeq] | None = None) -> None:
        """``commit`` for registered, distinct ``rows`` (B,) at once; ``token_ids`` (aligned with rows)
        replaces the sequences hashed from, when the engine does not hand over growing lists."""
        nc = num_computed
        if token_ids is not None:
            for row, toks in zip(rows.tolist(), token_ids, strict=True):
                self._tokens[row] = self.hasher.source(toks)
        self._num_computed[rows] = nc
        if self.enable_prefix_caching:
            for m in self.owners:           # first: a new checkpoint makes the blocks before it worth registering
                m.commit(rows, nc, chain=self._ensure_hashes, prompt_chain=self._prompt_chain_of,
                         sharing=self.sharing)
            if self._num_attn_groups:
                self._cache_full_blocks(rows, nc)
        for m, m_rows, m_nc in self._due_frees(rows, nc):
            m.remove_skipped_blocks(m_rows, m_nc, assume_due=True)

    def _due_frees(self, rows: np.ndarray, nc: np.ndarray) -> list[tuple[AttentionManager, np.ndarray, np.ndarray]]:
        """Per early-freeing manager, the rows (and their num_computed) that free a block now."""
        out = []
        for m in self._early:
            due = nc >= m.next_free[rows]
            if _count(due):
                out.append((m, rows[due], nc[due]))
        return out

    def _ensure_hashes(self, row: int, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes[row]
        if len(hashes) < num_blocks:
            tokens = self._tokens[row]
            if tokens is None:
                raise ValueError(f"request {self._req_ids[row]!r}: prefix caching needs its token_ids "
                                 "(pass them to allocate or commit)")
            self.hasher.extend(hashes, tokens, num_blocks)
        return hashes

    def _cache_full_blocks(self, rows: np.ndarray, nc: np.ndarray) -> None:
        """Register the blocks that became full in every attention group (one op for all groups), up to
        the row's ``_cache_cap``."""
        bs = self.block_size
        full = np.minimum(nc // bs, self._cache_cap[rows])
        done = self._num_cached[rows]
        grew = full > done
        if not _count(grew):
            return
        g_rows, g_full, g_done = rows[grew], full[grew], done[grew]
        hashes: list[BlockHash] = []
        hash_at, root, sources, chains = self.hasher.hash_at, self.hasher.root, self._tokens, self._hashes
        for row, a, b in zip(g_rows.tolist(), g_done.tolist(), g_full.tolist(), strict=True):
            chain = chains[row]
            source = sources[row]
            if b == a + 1 and len(chain) == a and source is not None:      # decode: one block, inline
                h = hash_at(chain[-1] if a else root, source, a)
                chain.append(h)
                hashes.append(h)
            else:
                hashes += self._ensure_hashes(row, b)[a:b]
        if len(hashes) == g_rows.size:
            rows_rep, cols = g_rows, g_done
        elif g_rows.size == 1:                  # one row's run of blocks (a Mamba checkpoint moved on)
            cols = np.arange(int(g_done[0]), int(g_full[0]))
            rows_rep = np.repeat(g_rows, cols.size)
        else:
            owner, cols = token_ranges(g_done, g_full - g_done)
            rows_rep = g_rows[owner]
        assert self.pool is not None
        self.pool.cache_blocks(self._attn_group_ids, hashes, self.block_tables.np[:, rows_rep, cols])
        self._num_cached[g_rows] = g_full

    def _set_prompt(self, row: int, num_prompt_tokens: int) -> None:
        self._prompt_known[row] = True
        for m in self.owners:
            m.set_prompt(row, num_prompt_tokens, int(self._num_computed[row]))

    def free(self, request_id: str) -> bool:
        """Release everything the request holds (finish, abort, preemption). Cached blocks stay
        findable until reused. Returns False for an unknown request."""
        row = self._rows.get(request_id)
        if row is None:
            return False
        num_cols = int(self._num_cols[row])
        for m in self.owners:
            m.free_row(row, num_cols)
        self._release_row(row)
        return True

    # -- row reordering --------------------------------------------------------------------------
    def swap_rows(self, a: int, b: int) -> None:
        """Swap two rows (registered or free) in every table and per-row array (batch reordering)."""
        if a == b:
            return
        self.block_tables.swap_rows(a, b)
        for m in self.owners:
            m.swap_rows(a, b)
        for arr in (self._num_computed, self._num_cached, self._prompt_known):
            arr[[a, b]] = arr[[b, a]]
        for lst in (self._hashes, self._tokens, self._req_ids):
            lst[a], lst[b] = lst[b], lst[a]  # type: ignore[index]
        for row in (a, b):
            rid = self._req_ids[row]
            if rid is not None:
                self._rows[rid] = row
        fa, fb = a in self._free_rows, b in self._free_rows
        if fa != fb:
            self._free_rows[self._free_rows.index(a if fa else b)] = b if fa else a

    def move_row(self, src: int, dst: int) -> None:
        """Move a registered row into a free row (condensing the batch)."""
        if self._req_ids[dst] is not None or self._req_ids[src] is None:
            raise ValueError(f"move_row needs a registered src and a free dst, got {src} -> {dst}")
        self.swap_rows(src, dst)

    # -- debugging -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when pools, tables and per-row state disagree (tests, debug mode)."""
        if self.pool:
            self.pool.check_invariants()
            refs = np.zeros(self.pool.num_blocks, np.int64)
            tables = self.block_tables.np
            for row in self._rows.values():
                n = int(self._num_cols[row])
                for m in self.managers:
                    ti = [self.table_index[g] for g in m.group_ids]
                    sk = int(m.num_skipped[row])
                    assert (tables[ti, row, :sk] == NULL_BLOCK).all(), "a skipped entry is not null"
                    held = tables[ti, row, sk:n]
                    assert (held != NULL_BLOCK).all(), "a live entry is null"
                    np.add.at(refs, held.reshape(-1), 1)
                assert (tables[:, row, n:] == NULL_BLOCK).all(), "an entry past num_blocks is set"
            for row in self._free_rows:
                assert (tables[:, row] == NULL_BLOCK).all() and self._num_cols[row] == 0, "free row dirty"
            assert (refs == self.pool.ref_count).all(), "ref counts != table entries holding the block"
        for m in self.owners:
            m.check_invariants()
        assert len(self._rows) + len(self._free_rows) == self.max_num_reqs, "row leak"

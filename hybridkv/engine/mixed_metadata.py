"""Static step metadata for the mixed-step graphs: full and sliding-window attention, and Mamba2's scans, inside the
capture.

A mixed step's attention depends on how its tokens split into requests, so the piecewise graphs
(``mixed_graphs.py``) used to break at every attention layer and run it eagerly: two Triton launches through
Python plus a copy per layer, most of a ~1B model's mixed step on the host. Full and sliding-window attention
need no break: the Triton kernels read only device metadata, and their grids depend on the token and request
counts only (a q-block grid of ``tokens // BLOCK_Q + requests`` programs, each finding its request by a search
over ``query_start_loc``). So each bucket of T tokens captures them over buffers that hold a step of up to
R = min(T, max_num_seqs) requests and one more, and a step fills the buffers before the replay:

    int64: per group a: slot mapping (T_max,)                      tokens n_tok.. : -1 (no KV write)
    int32: query_start_loc (R_max + 2,)                             request n owns tokens n_tok..T; then T (empty)
           per group a: seq_lens (R_max + 1,)                        requests n.. : 0
           block tables (R_max + 1, sum of W_a), row-interleaved:      rows n.. and columns past a row's keys: stale,
             group a is columns c_a..c_a + W_a of every row          never read

Every bucket's views start at the same bytes (only one replays at a time). The padded tokens belong to request n,
which has no keys: its rows come out zero (finite, as the break buffers' zeros were: nothing downstream sees stale
memory, even an op that mixes rows such as MoE routing) and write no KV; the requests after it own no query, so
their programs exit at once. No captured op lets a padded row change a real row's value.
W_a is the widest row the group's step can read: the model's length in blocks for full attention; for a sliding
window the window plus the largest bucket (the engine's rows start at their first live block, ``StepTables``). A
step whose tables are wider runs eagerly, padded to the bucket.

The step's own inputs ride in the same buffers, so a step that replays the graphs makes no other host-to-device
copy (a second packed copy and the eager take of the pending ids cost a Gemma-3-like mixed step ~0.3 ms of host
time on an H200's host, ``benchmarks/gpu_mixed_step.py``):

    int64: input ids, positions (T_max,)                          tokens n_tok.. : stale, valid values (ids >= 0)
           sources of pending input ids (T_max,)                  tokens n_tok.. : -1
           the logits head's row indices (H,)                     rows k..64: row k - 1 again (0 if none); past
                                                                    them stale, never read
           write the logits? (1,)                                 the head graph's flag
    device only: the pending ids' source (H + 1,)                  the step in flight's sampled tokens, copied there

H is max(T_max, R_max) rounded up to the head's row granule (64), the most rows a step's padded head reads. The
region goes over whole each step: 32 x T_max bytes or so, ~130 KB at 4096 tokens, a few µs of copy.

The graph takes the pending ids itself (``take_pending`` on the device, captured), so the sampled tokens of the
step in flight never visit the host. Every bucket's graph ends by gathering the hidden states of the first 64 head
rows for the head's own graph (``MixedStepGraphs.run_head``), so those 64 are always valid rows of the step.

One copy moves the step's inputs, the slots, offsets, lengths and the first n rows of the tables (every group's: n x
sum of W_a x 4 bytes; the rows' stride is fixed at capture, so a narrower step still moves whole rows).

Groups of state slots whose layers say so (``static_slots``: Mamba2) are captured the same way. Their Triton conv
and scan kernels read the offsets, slots and flags on the device, with grids from shapes; captured, every request
takes the packed scan (a decode is a one-token request that continues from its slot), so the op has one form for
any split of the step:

    int64: per state group m: working slot (R_max + 1,)             requests n.. : -1 (never read, never written)
    bool:  per state group m: has_initial_state (R_max + 1,)        requests n.. : False

The padded request n scans its tokens from a zero state and writes none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hybridkv.backends.builders import AttentionInputs, MambaInputs
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from hybridkv.metadata import CommonAttentionMetadata

STATIC_KINDS = (FullAttentionSpec, SlidingWindowSpec)
"""The group kinds whose attention runs inside the mixed graphs (exact types: MLA and chunked-local attention,
whose transforms change the request count, keep their graph breaks)."""


def static_groups(plan: KVCachePlan) -> tuple[int, ...]:
    """Plan group indices whose attention the mixed graphs capture."""
    return tuple(i for i, g in enumerate(plan.groups) if type(g.spec) in STATIC_KINDS)


def static_state_groups(plan: KVCachePlan, layers: Mapping[str, object]) -> tuple[int, ...]:
    """Plan indices of the state-slot groups whose every layer (``layers``: cache name -> module) runs its step op over
    static slot inputs (``static_slots``)."""
    return tuple(i for i, g in enumerate(plan.groups) if isinstance(g.spec, MambaSpec)
                 and all(getattr(layers.get(name), "static_slots", False) for name in g.cache_names))


def static_table_width(spec: KVCacheSpec, *, max_model_len: int, max_tokens: int) -> int:
    """The block-table columns a captured step of at most ``max_tokens`` tokens gives a group of ``spec``, a
    multiple of 16 (the width the eager path pads to): the model's length for full attention; for a sliding
    window, the window and the step's tokens from a row's first live block (+2: both ends may sit mid-block)."""
    blocks = -(-max_model_len // spec.block_size)
    if isinstance(spec, SlidingWindowSpec):
        blocks = min(blocks, -(-(spec.sliding_window + max_tokens) // spec.block_size) + 2)
    return _aligned(blocks)


HEAD_ROWS_UNIT = 64
"""The logits head's row granule (``mixed_graphs.HEAD_GRANULE`` is this one): the head rows region is sized in its
multiples, so a step's padded head rows always fit."""


def _aligned(n: int, unit: int = 16) -> int:
    return -(-n // unit) * unit


class MixedStepBuffers:
    """The mixed graphs' static step metadata: one host and one device allocation (``pin`` False: no GPU needed),
    views for every bucket, and the step's packing and copies. ``groups``: the attention groups (``static_groups``);
    ``state_groups``: the state-slot groups captured too (``static_state_groups``)."""

    def __init__(self, plan: KVCachePlan, *, max_tokens: int, max_reqs: int, device: torch.device | str,
                 pin: bool, state_groups: Sequence[int] = ()) -> None:
        self.plan = plan
        self.groups = static_groups(plan)
        self.state_groups = tuple(state_groups)
        specs = [plan.groups[g].spec for g in self.groups]
        self.names = frozenset(name for g in (*self.groups, *self.state_groups)
                               for name in plan.groups[g].cache_names)
        # every group of the plan is packed here: a step that replays the graphs needs no other copy
        self.covers_plan = len(set(self.groups) | set(self.state_groups)) == len(plan.groups)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.widths = tuple(static_table_width(s, max_model_len=plan.max_model_len, max_tokens=max_tokens)
                            for s in specs)
        a, m, t, r = len(self.groups), len(self.state_groups), max_tokens, max_reqs + 1   # + the padded tokens' request
        # byte offsets: the step's ids, positions, sources and head rows, slots and state slots (int64), then qsl and
        # seq_lens (int32), the initial-state flags (bool), then the tables, row-interleaved (request r's row of every
        # group, then r + 1's): the first n requests' rows of all groups are one span, so a step's fields go over in
        # one copy; every group's field from a 16-byte boundary (Triton specializes on a pointer's alignment: one
        # compile serves every group)
        self._slot_stride, self._idx_stride, self._seq_stride, self._init_stride = (
            _aligned(t, 2), _aligned(r, 2), _aligned(r, 4), _aligned(r, 16))
        # the head's rows (and the pending ids' source): a step's logits rows are at most its tokens, and the head pads
        # them to a multiple of 64 (``mixed_graphs.HEAD_GRANULE``)
        self._rows_stride = _aligned(max(t, max_reqs), HEAD_ROWS_UNIT)
        self._slots_at = 8 * (3 * self._slot_stride + self._rows_stride + 2)     # (+ the flag, 16-byte aligned)
        self._idx_at = self._slots_at + 8 * a * self._slot_stride
        self._qsl_at = self._idx_at + 8 * m * self._idx_stride
        self._seq_at = self._qsl_at + _aligned(4 * (r + 1))
        self._init_at = _aligned(self._seq_at + 4 * a * self._seq_stride)
        self._tables_at = _aligned(self._init_at + m * self._init_stride)
        self._columns = tuple(int(c) for c in np.cumsum([0, *self.widths]))     # each group's first column
        self._row_bytes = 4 * self._columns[-1]
        nbytes = self._tables_at + r * self._row_bytes
        self.host = torch.zeros(max(nbytes, 16), dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.zeros_like(self.host, device=device)
        (self.h_ids, self.h_pos, self.h_src, self.h_rows, self.h_flag, self.h_slots, self.h_idx, self.h_qsl,
         self.h_seq, self.h_init, self.h_tables) = self._views(self.host.numpy())
        (self.d_ids, self.d_pos, self.d_src, self.d_rows, self.d_flag, self.d_slots, self.d_idx, self.d_qsl,
         self.d_seq, self.d_init, self.d_tables) = self._views(self.dev)
        self.d_prev = torch.zeros(self._rows_stride + 1, dtype=torch.int64, device=device)   # the pending ids' source
        self._copied = torch.cuda.Event() if self.dev.is_cuda else None
        self._rows = r                  # rows of the last packing (those past it are padding already)
        self._tokens = t                # tokens of the last packing (slots past it are -1 already)
        self.pad()

    def _views(self, buf: np.ndarray | torch.Tensor) -> tuple:
        """(ids, positions, sources (T,), the head's rows (max(T, R),), the write-logits flag (1,), slots (groups, T),
        state slots (state groups, R + 1), qsl (R + 2,), seq_lens (groups, R + 1), has_initial_state (state groups,
        R + 1), [table (R + 1, W_a), rows strided by every group's columns]) over ``buf``."""
        a, m, r = len(self.groups), len(self.state_groups), self.max_reqs + 1
        i64, i32, b8 = ((torch.int64, torch.int32, torch.bool) if isinstance(buf, torch.Tensor)
                        else (np.int64, np.int32, np.bool_))
        step = buf[:self._slots_at].view(i64)
        t = self._slot_stride
        h = 3 * t + self._rows_stride
        ids, pos, src, rows_, flag = step[:t], step[t:2 * t], step[2 * t:3 * t], step[3 * t:h], step[h:h + 1]
        slots = buf[self._slots_at:self._idx_at].view(i64).reshape(a, self._slot_stride)
        idx = buf[self._idx_at:self._qsl_at].view(i64).reshape(m, self._idx_stride)
        qsl = buf[self._qsl_at:self._qsl_at + 4 * (r + 1)].view(i32)
        seq = buf[self._seq_at:self._seq_at + 4 * a * self._seq_stride].view(i32).reshape(a, self._seq_stride)
        init = buf[self._init_at:self._init_at + m * self._init_stride].view(b8).reshape(m, self._init_stride)
        rows = buf[self._tables_at:self._tables_at + r * self._row_bytes].view(i32).reshape(r, self._columns[-1])
        tables = [rows[:, c:c + w] for c, w in zip(self._columns[:-1], self.widths, strict=True)]
        return ids, pos, src, rows_, flag, slots, idx, qsl, seq, init, tables

    # -- capture --------------------------------------------------------------------------------
    def inputs(self, bucket: int) -> dict[str, AttentionInputs | MambaInputs]:
        """Every static layer's inputs for a ``bucket``-token step, over views of the device buffer. The host
        fields hold only what is fixed per bucket (the captured ops read no other host metadata)."""
        r = min(bucket, self.max_reqs) + 1
        qsl = self.d_qsl[:r + 1]
        zeros = np.zeros(r, np.int32)
        out: dict[str, AttentionInputs | MambaInputs] = {}
        for m, g in enumerate(self.state_groups):       # no decodes apart: every request through the scan
            scan = MambaInputs(query_start_loc=qsl, state_indices=self.d_idx[m, :r],
                               has_initial_state=self.d_init[m, :r], num_decodes=0, num_decode_tokens=0,
                               prefill_query_start_loc=qsl, num_reqs=r)
            out.update(dict.fromkeys(self.plan.groups[g].cache_names, scan))
        for a, g in enumerate(self.groups):
            group = self.plan.groups[g]
            spec = group.spec
            table = self.d_tables[a][:r]
            cam = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=np.zeros(r + 1, np.int32), seq_lens=self.d_seq[a, :r],
                seq_lens_cpu=zeros, num_computed_tokens_cpu=zeros, key_start=torch.zeros_like(qsl[:r]),
                key_start_cpu=zeros, block_table_tensor=table, block_table_cpu=np.zeros(tuple(table.shape), np.int32),
                slot_mapping=self.d_slots[a, :bucket], block_size=spec.block_size, num_reqs=r,
                num_actual_tokens=bucket, max_query_len=bucket,
                # every row packed fits the table width (``fits``): a bound the kernels may size by
                max_seq_len=min(self.widths[a] * spec.block_size, self.plan.max_model_len))
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            out.update(dict.fromkeys(group.cache_names, AttentionInputs(cam=cam, slot_mapping=cam.slot_mapping,
                                                                        sliding_window=window)))
        return out

    def pad(self, bucket: int = 0) -> None:
        """A step of padding only, copied: request 0 owns the ``bucket`` tokens, with no keys and no state (the
        capture's warm-up: finite rows, no KV writes, and no state writes from the Triton kernels, which never
        dereference slot -1)."""
        self._wait()
        self.h_ids[:] = 0
        self.h_pos[:] = 0
        self.h_src[:] = -1
        self.h_rows[:] = 0
        self.h_flag[:] = 1
        self.h_qsl[0] = 0
        self.h_qsl[1:] = bucket
        self.h_seq[:] = 0
        self.h_slots[:] = -1
        self.h_idx[:] = -1
        self.h_init[:] = False
        self._rows, self._tokens = self.max_reqs + 1, 0
        self.dev.copy_(self.host)

    # -- a step ---------------------------------------------------------------------------------
    def fits(self, num_reqs: int, widths: Sequence[int]) -> bool:
        """Whether a step of ``num_reqs`` requests whose static groups' tables have ``widths`` columns fits."""
        return num_reqs <= self.max_reqs and all(w <= cap for w, cap in zip(widths, self.widths, strict=True))

    def pack_step(self, ids: np.ndarray, positions: np.ndarray, sources: np.ndarray | None,
                  head_rows: np.ndarray, *, write_logits: bool = True) -> None:
        """The step's own inputs, host side (before ``pack``): (n_tok,) int64 ids and positions, the (n_tok,) sources
        of pending ids (>= 0: the step in flight's sampled token there; None: none pending), the (k,) int64 rows
        the logits head reads (the first ``HEAD_ROWS_UNIT`` always valid rows: the last one repeated, or row 0),
        and whether the head graph writes its logits."""
        self._wait()
        n = int(ids.shape[0])
        # a pending id's placeholder is replaced on the device, but later, shorter steps keep it in their padded rows,
        # which the embedding reads: only valid ids are packed
        np.maximum(ids, 0, out=self.h_ids[:n])
        self.h_pos[:n] = positions
        self.h_src[:n] = -1 if sources is None else sources
        self.h_src[n:] = -1
        k = int(head_rows.shape[0])
        self.h_rows[:k] = head_rows
        self.h_rows[k:HEAD_ROWS_UNIT] = head_rows[-1] if k else 0     # (every bucket's graph gathers up to these)
        self.h_flag[0] = write_logits

    def head_rows(self, k: int) -> torch.Tensor:
        """The device view of the step's (k,) head rows (``pack_step``)."""
        return self.d_rows[:k]

    def take_prev(self, prev_tokens: torch.Tensor) -> None:
        """The step in flight's sampled tokens (r,) where the captured ``take_pending`` reads them (a device copy,
        in stream order: the graph that reads them runs after it)."""
        self.d_prev[:prev_tokens.shape[0]].copy_(prev_tokens)

    def pack(self, qsl: np.ndarray, groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], *,
             bucket: int, states: Sequence[tuple[np.ndarray, np.ndarray]] = ()) -> None:
        """The host side for a step that replays ``bucket``: ``qsl`` (n + 1,) int32 query offsets; per static group
        (plan order) its (n,) int32 seq_lens, (n, w) int32 block table and (num_tokens,) int64 slots; per state
        group its (n,) working slots and (n,) bool has-initial-state flags; padding past them (request n owns the
        tokens up to ``bucket``)."""
        self._wait()
        n, tokens = int(qsl.shape[0]) - 1, int(qsl[-1])
        if not tokens <= bucket <= self.max_tokens:
            raise ValueError(f"a {tokens}-token step cannot replay a {bucket}-token bucket (at most {self.max_tokens})")
        if len(groups) != len(self.groups) or len(states) != len(self.state_groups):
            raise ValueError(f"{len(groups)} attention and {len(states)} state groups packed, the buffers hold "
                             f"{len(self.groups)} and {len(self.state_groups)}")
        self.h_qsl[:n + 1] = qsl
        self.h_qsl[n + 1:] = bucket
        self._tokens = max(self._tokens, tokens)      # (slots written up to here, should this packing fail midway)
        for a, (seq, table, slots) in enumerate(groups):
            self.h_seq[a, :n] = seq
            self.h_tables[a][:n, :table.shape[1]] = table
            self.h_slots[a, :tokens] = slots
        for m, (slot, started) in enumerate(states):
            self.h_idx[m, :n] = slot
            self.h_init[m, :n] = started
        self.h_seq[:, n:self._rows] = 0
        self.h_idx[:, n:self._rows] = -1
        self.h_init[:, n:self._rows] = False
        self.h_slots[:, tokens:self._tokens] = -1      # (past the last packing's tokens: -1 already)
        self._rows = n + 1                 # (request n's row: no keys, so its table is never read)
        self._tokens = tokens

    def upload(self) -> None:
        """The packed step to the device (on the current stream) in one copy: the step's inputs, slots, offsets,
        lengths, flags and the step's table rows (a copy costs the host ~20 µs: one per group was a tenth of a
        Gemma-3-like mixed step). The host side may be packed again once it has run."""
        end = self._tables_at + (self._rows - 1) * self._row_bytes
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.dev.device))

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

"""CUDA graphs for decode steps.

A decode step of a small or mid-size model is launch-bound: a thousand-odd small kernels whose launch
costs more than their work. Here the whole forward (embedding to fp32 logits) is captured once per
batch-size bucket and replayed. What changes from step to step lives in persistent device buffers that
the captured kernels read:

    int64 buffer: input ids (B,) | positions (B,) | per attention group: slot mapping (B,) | per Mamba
                  group: state slot (B,) | sources of pending input ids (B,) | write the logits? (1,)
    int32 buffer: per attention group: seq_lens (B,) | block table (B, width)

B is the bucket: each bucket lays its fields out from byte 0 of one shared allocation on each side
(``DecodeBuffers``: the int64 buffer, then the int32 one), so a step packs and copies only its bucket's
bytes. With one layout for the largest bucket every step would copy every group's full-width table for
``max_num_seqs`` rows: 4.6 MB for a Gemma-3-1B-shaped model at its defaults (32k context, 256 sequences), at
batch 1 too. The host packs the pinned twin (``pack_host``, numpy only, so testable without a GPU), one copy
moves it, then the graph of the smallest bucket >= the batch replays. Everything else a decode step does on
the device is inside the graph too: it takes the input ids still pending from the previous step's tokens
(asynchronous scheduling) and ends with the greedy tokens, the logits' argmax, in a persistent buffer that
the next step's pending ids come from (the logits head takes the argmax in its epilogue:
``HybridModel.compute_logits_and_greedy``), and the tokens' report for the host: ``NONFINITE`` where the chosen
logit, the row's maximum, is not finite (the argmax's reduction stores it beside the token: no extra launch,
though a greedy step leaves the logits unwritten). With both outside the graph, 62-72 µs of device work and gaps
separated two replays of the Gemma-3-like model at batch 32 on an H100 (the argmax alone 25.4 µs), 16-26 µs
since (``benchmarks/gpu_step_gaps.py``). The engine's ``StepTables`` are packed
directly (``DecodeTables``: a few vectorised numpy ops per group kind, no CAM, no builder, which at 13
groups were most of a step's host work); any other block tables go through the eager path's per-group CAMs
and builders on host arrays, whose results are the same by construction (``tests/test_decode_packing.py``
holds the two equal). Only decode batches run this way (one new token per request, every request continuing,
logits for every row); anything else runs eagerly.

A decode batch has one query per request, so every group kind has the same shape: sliding-window
trimming shifts a row's table and shortens its seq_len, local attention's virtual batch is the request
itself (seq_len relative to its chunk start): no device-to-host sync and no shape depends on the data.
Padded rows (bucket > batch) attend one key of the null block (which is never written: their slot is
-1, skipped), and run their Mamba update on the null state slot 0, which padding alone uses as scratch.

Capture needs a backend whose ops read only device metadata (``KernelBackend.cuda_graph_safe``): an op
that loops over ``cam.*_cpu`` on the host would bake the capture-time batch into the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from hybridkv.backends.builders import AttentionInputs, DecodeRows, MambaInputs, decode_rows, decode_table_width
from hybridkv.backends.registry import KernelBackend
from hybridkv.engine.sampler import take_pending
from hybridkv.forward_context import ForwardContext, forward_context
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import KVCacheSpec, SlidingWindowSpec
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.models.hybrid import HybridModel
from hybridkv.transforms.block_rows import gather_block_rows

logger = logging.getLogger("hybridkv.engine")

_NULL_SLOT = 0
_Buf = TypeVar("_Buf", torch.Tensor, np.ndarray)     # a flat buffer: device, pinned host, or its numpy view


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding waste stays under ~1/8 past 64."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max(max_num_seqs, 96) + 1, 32))
    out = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Offsets of every field in the two flat buffers (host pinned and device), for B = max bucket."""

    max_batch: int
    attention: tuple[int, ...]           # plan group indices of attention groups
    mamba: tuple[int, ...]               # plan group indices of Mamba groups
    widths: tuple[int, ...]              # block-table width per attention group
    specs: tuple[KVCacheSpec, ...]       # per attention group: its spec (the builders' decode rule and block size)
    spec_ids: tuple[int, ...]            # per attention group: the first one with an equal spec (shared decode rows)
    table_starts: tuple[int, ...]        # offset of each attention group's table in the int32 buffer
    i64_size: int
    i32_size: int
    column0: np.ndarray = field(compare=False, repr=False)   # (attention, B) int64: each table row's offset

    @staticmethod
    def make(plan: KVCachePlan, max_batch: int) -> _Layout:
        attention = tuple(i for i, g in enumerate(plan.groups) if g.spec.is_attention)
        mamba = tuple(i for i, g in enumerate(plan.groups) if not g.spec.is_attention)
        specs = tuple(plan.groups[i].spec for i in attention)
        spec_ids = tuple(specs.index(spec) for spec in specs)
        widths = tuple(decode_table_width(spec, max_model_len=plan.max_model_len) for spec in specs)
        b = max_batch
        w = np.array(widths, np.int64)
        starts = b * (len(attention) + np.cumsum(w) - w)            # (attention,) where each table begins
        return _Layout(max_batch=b, attention=attention, mamba=mamba, widths=widths, specs=specs, spec_ids=spec_ids,
                       table_starts=tuple(starts.tolist()), i64_size=b * (3 + len(attention) + len(mamba)) + 1,
                       i32_size=b * len(attention) + b * sum(widths),
                       column0=starts[:, None] + w[:, None] * np.arange(b))

    @property
    def nbytes(self) -> int:
        """Both buffers' bytes: the int64 one, then the int32 one."""
        return 8 * self.i64_size + 4 * self.i32_size

    # int64 fields
    def ids(self, buf: _Buf, n: int) -> _Buf:
        return buf[:n]

    def positions(self, buf: _Buf, n: int) -> _Buf:
        return buf[self.max_batch:self.max_batch + n]

    def slots(self, buf: _Buf, a: int, n: int) -> _Buf:
        start = self.max_batch * (2 + a)
        return buf[start:start + n]

    def state_slots(self, buf: _Buf, m: int, n: int) -> _Buf:
        start = self.max_batch * (2 + len(self.attention) + m)
        return buf[start:start + n]

    def sources(self, buf: _Buf, n: int) -> _Buf:
        start = self.max_batch * (2 + len(self.attention) + len(self.mamba))
        return buf[start:start + n]

    def write_logits(self, buf: _Buf) -> _Buf:
        """(1,): nonzero = the step's caller reads the logits (else the head may skip writing them)."""
        return buf[self.i64_size - 1:self.i64_size]

    # int32 fields
    def seq_lens(self, buf: _Buf, a: int, n: int) -> _Buf:
        start = self.max_batch * a
        return buf[start:start + n]

    def table(self, buf: _Buf, a: int, n: int) -> _Buf:
        b, w, start = self.max_batch, self.widths[a], self.table_starts[a]
        return buf[start:start + b * w].reshape(b, w)[:n]

    # every group's field at once, (groups, B)
    def all_slots(self, buf: _Buf) -> _Buf:
        b = self.max_batch
        return buf[2 * b:(2 + len(self.attention)) * b].reshape(len(self.attention), b)

    def all_state_slots(self, buf: _Buf) -> _Buf:
        b, a = self.max_batch, len(self.attention)
        return buf[(2 + a) * b:(2 + a + len(self.mamba)) * b].reshape(len(self.mamba), b)

    def all_seq_lens(self, buf: _Buf) -> _Buf:
        return buf[:len(self.attention) * self.max_batch].reshape(len(self.attention), self.max_batch)


@dataclass(frozen=True, kw_only=True)
class DecodeTables:
    """A decode batch's tables in the engine's ``StepTables`` form (rows as the coordinator keeps them, each
    query's KV slot ready): ``pack_host`` packs them with no CAM and no builder."""

    seq_lens: np.ndarray                   # (n,) keys each request reads; its one query sits at seq_len - 1
    tables: Sequence[np.ndarray]           # per plan group, (n, *) int32 from column starts[g]; Mamba: slot in col 0
    starts: Sequence[np.ndarray | None]    # per plan group, (n,) int32 first logical block, None = column 0
    slots: Sequence[np.ndarray | None]     # per plan group, (n,) int64 KV slot of each query (None for Mamba)


def _put_attention(lay: _Layout, h64: np.ndarray, h32: np.ndarray, a: int, n: int, slots: np.ndarray,
                   seq_lens: np.ndarray, table: np.ndarray) -> None:
    """Attention group ``a``'s rows 0..n: slots (n,), seq_lens (n,), table (n, w): its first w columns."""
    width = table.shape[1]
    if width > lay.widths[a]:
        raise RuntimeError(f"CUDA graphs: group {lay.attention[a]} table width {width} > {lay.widths[a]}")
    lay.slots(h64, a, n)[:] = slots
    lay.seq_lens(h32, a, n)[:] = seq_lens
    lay.table(h32, a, n)[:, :width] = table


def _pack_tables(lay: _Layout, h64: np.ndarray, h32: np.ndarray, step: DecodeTables, n: int) -> None:
    """Every group's fields straight from ``step``. Groups of one kind share their rows' starts (the same
    array: the coordinator keeps them per manager), so each (kind, start) computes its lengths once."""
    s = step.seq_lens.astype(np.int32)
    rows = np.arange(n)
    kept: dict[tuple[int, int], DecodeRows] = {}
    for a, gi in enumerate(lay.attention):
        start, table = step.starts[gi], step.tables[gi]
        key = (lay.spec_ids[a], id(start))
        if key not in kept:
            kept[key] = decode_rows(lay.specs[a], s, start)
        d = kept[key]
        seq = d.seq_lens
        if d.col0 is not None:
            table = gather_block_rows(table, rows, d.col0, d.num_blocks, d.width)
        slots = step.slots[gi]
        assert slots is not None
        _put_attention(lay, h64, h32, a, n, slots, seq, table)
    for m, gi in enumerate(lay.mamba):
        lay.state_slots(h64, m, n)[:] = step.tables[gi][:, 0]


def _pack_built(lay: _Layout, h64: np.ndarray, h32: np.ndarray,
                inputs: Sequence[AttentionInputs | MambaInputs], n: int) -> None:
    """Every group's fields from the eager builders' host-side results (plan group order)."""
    for a, gi in enumerate(lay.attention):
        built = inputs[gi]
        assert isinstance(built, AttentionInputs)
        cam = built.cam
        if cam.num_reqs != n:
            raise RuntimeError(f"CUDA graphs: group {gi} has {cam.num_reqs} rows for {n} decode requests")
        _put_attention(lay, h64, h32, a, n, built.slot_mapping.numpy(), cam.seq_lens_cpu, cam.block_table_cpu)
    for m, gi in enumerate(lay.mamba):
        built = inputs[gi]
        assert isinstance(built, MambaInputs)
        lay.state_slots(h64, m, n)[:] = built.state_indices.numpy()


def fill_padding(lay: _Layout, h64: np.ndarray, h32: np.ndarray, n: int, stop: int) -> None:
    """Rows n..stop of every field: token 0 at position 0 (none pending), one key in the null block, no KV
    write, the null state slot."""
    b = lay.max_batch
    h64[:2 * b].reshape(2, b)[:, n:stop] = 0
    lay.sources(h64, stop)[n:] = -1
    lay.all_slots(h64)[:, n:stop] = -1
    lay.all_seq_lens(h32)[:, n:stop] = 1
    h32[lay.column0[:, n:stop]] = 0
    lay.all_state_slots(h64)[:, n:stop] = _NULL_SLOT


def pack_host(lay: _Layout, h64: np.ndarray, h32: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
              inputs: DecodeTables | Sequence[AttentionInputs | MambaInputs], *,
              sources: np.ndarray | None = None, stale: int | None = None, write_logits: bool = True) -> None:
    """The host buffers (numpy views of the layout's int64 / int32 buffers) for a decode batch of
    n = len(input_ids) requests: ids and positions (n,), every group's fields from ``inputs``, ``sources``
    (n,) when given, the logits flag, and padding in rows n..: ``stale`` = the rows a previous packing filled
    (those past it are padding already; None = any row may be stale). Columns past a row's table keep what
    they held: no kernel reads them."""
    n = int(input_ids.shape[0])
    h64[:n] = input_ids
    lay.positions(h64, n)[:] = positions
    if isinstance(inputs, DecodeTables):
        _pack_tables(lay, h64, h32, inputs, n)
    else:
        _pack_built(lay, h64, h32, inputs, n)
    lay.sources(h64, n)[:] = -1 if sources is None else sources
    lay.write_logits(h64)[:] = int(write_logits)
    fill_padding(lay, h64, h32, n, lay.max_batch if stale is None else stale)


@dataclass(frozen=True, kw_only=True)
class BucketViews:
    """One bucket's layout over the shared buffers: numpy views of the host buffer, views of the device one."""

    layout: _Layout
    host64: np.ndarray
    host32: np.ndarray
    dev64: torch.Tensor
    dev32: torch.Tensor


class DecodeBuffers:
    """The persistent metadata buffers: one host and one device allocation, every bucket's layout from byte 0
    of both, and which bucket and rows the host side was last packed for. Needs no GPU (``pin`` False)."""

    def __init__(self, plan: KVCachePlan, buckets: Sequence[int], *, device: torch.device, pin: bool) -> None:
        layouts = [_Layout.make(plan, b) for b in sorted(set(buckets))]
        self.host = torch.zeros(layouts[-1].nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.zeros_like(self.host, device=device)
        self.views: dict[int, BucketViews] = {}
        for lay in layouts:
            split, end = 8 * lay.i64_size, lay.nbytes
            self.views[lay.max_batch] = BucketViews(
                layout=lay, host64=self.host[:split].view(torch.int64).numpy(),
                host32=self.host[split:end].view(torch.int32).numpy(),
                dev64=self.dev[:split].view(torch.int64), dev32=self.dev[split:end].view(torch.int32))
        self._packed: tuple[int, int] | None = None    # (bucket, rows) of the last packing: rows past it are padding

    def pad(self, bucket: int) -> int:
        """Every row of ``bucket`` padding (capture's warm-ups: no KV write, no state); returns the bytes to copy."""
        v = self.views[bucket]
        fill_padding(v.layout, v.host64, v.host32, 0, bucket)
        v.layout.write_logits(v.host64)[:] = 1
        self._packed = (bucket, 0)
        return v.layout.nbytes

    def pack(self, bucket: int, input_ids: np.ndarray, positions: np.ndarray,
             inputs: DecodeTables | Sequence[AttentionInputs | MambaInputs], *,
             sources: np.ndarray | None = None, write_logits: bool = True) -> int:
        """``pack_host`` in ``bucket``'s layout; returns the bytes to copy. A switch of bucket re-pads every row:
        the bytes held another layout."""
        v = self.views[bucket]
        stale = self._packed[1] if self._packed is not None and self._packed[0] == bucket else None
        pack_host(v.layout, v.host64, v.host32, input_ids, positions, inputs, sources=sources, stale=stale,
                  write_logits=write_logits)
        self._packed = (bucket, int(input_ids.shape[0]))
        return v.layout.nbytes


class DecodeGraphs:
    """Captured decode forwards, one per bucket, over shared persistent buffers and one memory pool."""

    def __init__(self, model: HybridModel, plan: KVCachePlan, backend: KernelBackend, *,
                 buckets: Sequence[int]) -> None:
        if not backend.cuda_graph_safe:
            raise ValueError(f"kernel backend {backend.name!r} reads host metadata inside its ops; "
                             "CUDA graphs need one that reads device metadata only (e.g. 'triton')")
        self.model, self.plan, self.backend = model, plan, backend
        self.device = next(model.parameters()).device
        self.buckets = tuple(sorted(set(buckets)))
        self.buffers = DecodeBuffers(plan, self.buckets, device=self.device, pin=True)
        self._arange = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=self.device)
        # the greedy tokens of the last replay: the next step's pending input ids are read from here
        self._tokens = torch.zeros(self.buckets[-1], dtype=torch.int64, device=self.device)
        # ... and as the host reads them: NONFINITE where the chosen logit is not finite
        self._report = torch.zeros(self.buckets[-1], dtype=torch.int64, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardContext]] = {}
        self._copied = torch.cuda.Event()       # the pinned buffers may be rewritten once this has passed

    # -- capture ---------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            size = self.buffers.pad(b)
            self.buffers.dev[:size].copy_(self.buffers.host[:size])
            ctx = self._context(b)
            with forward_context(ctx):
                self._forward(b)                            # compile and warm up outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(b)
            self._graphs[b] = (graph, logits, ctx)     # ctx: keeps what the graph may read alive
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", ",".join(map(str, self.buckets)))

    def _forward(self, b: int) -> torch.Tensor:
        """A ``b``-row decode step from the persistent buffers: its pending input ids from the previous step's
        tokens, the forward, fp32 logits (returned), their argmax into ``_tokens`` and its report into
        ``_report`` (the chosen logit recomputed as one dot product per row: the logits may not be written)."""
        v = self.buffers.views[b]
        ids = take_pending(v.layout.ids(v.dev64, b), v.layout.sources(v.dev64, b), self._tokens)
        hidden = self.model(ids, v.layout.positions(v.dev64, b))
        out = self.model.compute_logits_and_greedy(hidden, out=self._tokens[:b], report=self._report[:b],
                                                   write_logits=v.layout.write_logits(v.dev64))
        if out is None:
            raise RuntimeError("CUDA graphs: compute_logits returned None (tensor-parallel ranks are not supported)")
        return out[0]

    def _context(self, b: int) -> ForwardContext:
        """Inputs for a ``b``-request decode batch whose device fields are views of the persistent buffers.
        Host fields hold only what is fixed per bucket (the ops read no other host metadata)."""
        v = self.buffers.views[b]
        lay, d64, d32 = v.layout, v.dev64, v.dev32
        qsl = self._arange[:b + 1]
        qsl_cpu = np.arange(b + 1, dtype=np.int32)
        ones = np.ones(b, np.int32)
        inputs: dict[str, AttentionInputs | MambaInputs] = {}
        for a, gi in enumerate(lay.attention):
            group = self.plan.groups[gi]
            spec = group.spec
            table = lay.table(d32, a, b)
            cam = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=lay.seq_lens(d32, a, b),
                seq_lens_cpu=ones, num_computed_tokens_cpu=ones, key_start=torch.zeros_like(qsl[:b]),
                key_start_cpu=np.zeros(b, np.int32), block_table_tensor=table,
                block_table_cpu=np.zeros(tuple(table.shape), np.int32), slot_mapping=lay.slots(d64, a, b),
                block_size=spec.block_size, num_reqs=b, num_actual_tokens=b, max_query_len=1,
                # every row packed fits the table width (checked per step): a bound the kernels may size by
                max_seq_len=min(lay.widths[a] * spec.block_size, self.plan.max_model_len))
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            built = AttentionInputs(cam=cam, slot_mapping=cam.slot_mapping, sliding_window=window)
            inputs.update(dict.fromkeys(group.cache_names, built))
        for m, gi in enumerate(lay.mamba):
            group = self.plan.groups[gi]
            built = MambaInputs(query_start_loc=qsl, state_indices=lay.state_slots(d64, m, b),
                                has_initial_state=torch.ones(b, dtype=torch.bool, device=self.device),
                                num_decodes=b, num_decode_tokens=b, prefill_query_start_loc=qsl[b:] - b,
                                num_reqs=b)
            inputs.update(dict.fromkeys(group.cache_names, built))
        return ForwardContext(inputs=inputs, backend=self.backend)

    # -- replay ----------------------------------------------------------------------------------
    def bucket_for(self, num_reqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_reqs:
                return b
        return None

    def run(self, input_ids: np.ndarray, positions: np.ndarray,
            inputs: DecodeTables | Sequence[AttentionInputs | MambaInputs], *, sources: np.ndarray | None = None,
            prev_tokens: torch.Tensor | None = None, logits: bool = True
            ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Replay for a decode batch of (n,) ``input_ids`` at (n,) ``positions``, its groups' fields from
        ``inputs`` (``pack_host``); returns fp32 logits (n, vocab_size) (None unless ``logits``: the head then
        skips writing them where it can), their argmax (n,) int64 and its report (``StepOutput.report``), all
        valid until the next replay.
        ``sources`` (n,) >= 0 takes those input ids from ``prev_tokens`` on the device (no copy when they are
        the tokens of the last replay, as in a run of greedy decode steps)."""
        n = int(input_ids.shape[0])
        b = self.bucket_for(n)
        assert b is not None
        self._copied.synchronize()
        size = self.buffers.pack(b, input_ids, positions, inputs, sources=sources, write_logits=logits)
        self.buffers.dev[:size].copy_(self.buffers.host[:size], non_blocking=True)
        self._copied.record()
        if sources is not None:
            assert prev_tokens is not None
            if prev_tokens.data_ptr() != self._tokens.data_ptr():
                self._tokens[:prev_tokens.shape[0]].copy_(prev_tokens)
        graph, out, _ = self._graphs[b]
        graph.replay()
        return (out[:n] if logits else None), self._tokens[:n], self._report[:n]

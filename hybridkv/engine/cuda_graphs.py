"""CUDA graphs for decode steps.

A decode step of a small or mid-size model is launch-bound: a thousand-odd small kernels whose launch
costs more than their work. Here the whole forward (embedding to fp32 logits) is captured once per
batch-size bucket and replayed. What changes from step to step lives in persistent device buffers that
the captured kernels read:

    int64 buffer: input ids (B,) | positions (B,) | per attention group: slot mapping (B,) | per Mamba
                  group: state slot (B,) | sources of pending input ids (B,)
    int32 buffer: per attention group: seq_lens (B,) | block table (B, width)

The host side is the eager one: the same per-group CAMs and transforms run on host arrays (zero-copy CPU
tensors), and their results are packed into pinned twins of those buffers; one copy per buffer moves
them, then the graph of the smallest bucket >= the batch replays. Only decode batches run this way (one
new token per request, every request continuing, logits for every row); anything else runs eagerly.

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
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.backends.builders import AttentionInputs, MambaInputs
from hybridkv.backends.registry import KernelBackend
from hybridkv.engine.sampler import take_pending
from hybridkv.forward_context import ForwardContext, forward_context
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.models.hybrid import HybridModel

logger = logging.getLogger("hybridkv.engine")

_NULL_SLOT = 0


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding waste stays under ~1/8 past 64."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max(max_num_seqs, 96) + 1, 32))
    out = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return tuple(out)


def table_width(spec: object, *, block_size: int, max_model_len: int) -> int:
    """Widest block-table row a decode request of ``spec`` reads after its group's transform."""
    full = -(-max_model_len // block_size)
    if isinstance(spec, SlidingWindowSpec):
        return min(full, -(-(spec.sliding_window - 1) // block_size) + 2)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return min(full, spec.attention_chunk_size // block_size + 1)
    return full


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Offsets of every field in the two flat buffers (host pinned and device), for B = max bucket."""

    max_batch: int
    attention: tuple[int, ...]           # plan group indices of attention groups
    mamba: tuple[int, ...]               # plan group indices of Mamba groups
    widths: tuple[int, ...]              # block-table width per attention group
    i64_size: int
    i32_size: int

    @staticmethod
    def make(plan: KVCachePlan, max_batch: int) -> _Layout:
        attention = tuple(i for i, g in enumerate(plan.groups) if g.spec.is_attention)
        mamba = tuple(i for i, g in enumerate(plan.groups) if not g.spec.is_attention)
        widths = tuple(table_width(plan.groups[i].spec, block_size=plan.groups[i].spec.block_size,
                                   max_model_len=plan.max_model_len) for i in attention)
        b = max_batch
        return _Layout(max_batch=b, attention=attention, mamba=mamba, widths=widths,
                       i64_size=b * (3 + len(attention) + len(mamba)),
                       i32_size=b * len(attention) + b * sum(widths))

    # int64 fields
    def ids(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[:n]

    def positions(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[self.max_batch:self.max_batch + n]

    def slots(self, buf: torch.Tensor, a: int, n: int) -> torch.Tensor:
        start = self.max_batch * (2 + a)
        return buf[start:start + n]

    def state_slots(self, buf: torch.Tensor, m: int, n: int) -> torch.Tensor:
        start = self.max_batch * (2 + len(self.attention) + m)
        return buf[start:start + n]

    def sources(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        start = self.max_batch * (2 + len(self.attention) + len(self.mamba))
        return buf[start:start + n]

    # int32 fields
    def seq_lens(self, buf: torch.Tensor, a: int, n: int) -> torch.Tensor:
        start = self.max_batch * a
        return buf[start:start + n]

    def table(self, buf: torch.Tensor, a: int, n: int) -> torch.Tensor:
        b = self.max_batch
        start = b * len(self.attention) + b * sum(self.widths[:a])
        return buf[start:start + b * self.widths[a]].reshape(b, self.widths[a])[:n]


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
        self.layout = lay = _Layout.make(plan, self.buckets[-1])
        self._host64 = torch.zeros(lay.i64_size, dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(lay.i32_size, dtype=torch.int32, pin_memory=True)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._dev64 = torch.zeros(lay.i64_size, dtype=torch.int64, device=self.device)
        self._dev32 = torch.zeros(lay.i32_size, dtype=torch.int32, device=self.device)
        self._arange = torch.arange(lay.max_batch + 1, dtype=torch.int32, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardContext]] = {}
        self._copied = torch.cuda.Event()       # the pinned buffers may be rewritten once this has passed

    # -- capture ---------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        self._fill_padding(0)                           # every row padding: warm-ups write no KV, no state
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)
        for b in reversed(self.buckets):
            ctx = self._context(b)
            ids, pos = self.layout.ids(self._dev64, b), self.layout.positions(self._dev64, b)
            with forward_context(ctx):
                self._forward(ids, pos)                     # compile and warm up outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(ids, pos)
            self._graphs[b] = (graph, logits, ctx)     # ctx: keeps what the graph may read alive
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", ",".join(map(str, self.buckets)))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(self.model(ids, positions))
        if logits is None:
            raise RuntimeError("CUDA graphs: compute_logits returned None (tensor-parallel ranks are not supported)")
        return logits

    def _context(self, b: int) -> ForwardContext:
        """Inputs for a ``b``-request decode batch whose device fields are views of the persistent buffers.
        Host fields hold only what is fixed per bucket (the ops read no other host metadata)."""
        lay, d64, d32 = self.layout, self._dev64, self._dev32
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
                max_seq_len=self.plan.max_model_len)
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            built = AttentionInputs(cam=cam, slot_mapping=cam.slot_mapping, sliding_window=window)
            inputs.update(dict.fromkeys(group.layer_names, built))
        for m, gi in enumerate(lay.mamba):
            group = self.plan.groups[gi]
            built = MambaInputs(query_start_loc=qsl, state_indices=lay.state_slots(d64, m, b),
                                has_initial_state=torch.ones(b, dtype=torch.bool, device=self.device),
                                num_decodes=b, num_decode_tokens=b, prefill_query_start_loc=qsl[b:] - b,
                                num_reqs=b)
            inputs.update(dict.fromkeys(group.layer_names, built))
        return ForwardContext(inputs=inputs, backend=self.backend)

    # -- replay ----------------------------------------------------------------------------------
    def bucket_for(self, num_reqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_reqs:
                return b
        return None

    def _fill_padding(self, n: int) -> None:
        """Rows n.. of every field: token 0 at position 0, one key in the null block, no KV write, the
        null state slot."""
        lay, h64, h32, b = self.layout, self._np64, self._np32, self.layout.max_batch
        h64[n:b] = 0
        h64[b + n:2 * b] = 0
        for a in range(len(lay.attention)):
            lay.slots(h64, a, b)[n:] = -1
            lay.seq_lens(h32, a, b)[n:] = 1
            lay.table(h32, a, b)[n:, 0] = 0
        for m in range(len(lay.mamba)):
            lay.state_slots(h64, m, b)[n:] = _NULL_SLOT

    def run(self, input_ids: np.ndarray, positions: np.ndarray, inputs: Sequence[AttentionInputs | MambaInputs],
            *, sources: np.ndarray | None = None, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode batch whose host-side per-group ``inputs`` (plan group order, built on the
        CPU) were made by the eager builders; returns fp32 logits (num_reqs, vocab_size), valid until the
        next replay. ``sources`` (B,) >= 0 takes those input ids from ``prev_tokens`` on the device."""
        n = int(input_ids.shape[0])
        b = self.bucket_for(n)
        assert b is not None
        lay, h64, h32 = self.layout, self._np64, self._np32
        self._copied.synchronize()
        h64[:n] = input_ids
        lay.positions(h64, n)[:] = positions
        for a, gi in enumerate(lay.attention):
            built = inputs[gi]
            assert isinstance(built, AttentionInputs)
            cam = built.cam
            if cam.num_reqs != n:
                raise RuntimeError(f"CUDA graphs: group {gi} has {cam.num_reqs} rows for {n} decode requests")
            lay.slots(h64, a, n)[:] = built.slot_mapping.numpy()
            lay.seq_lens(h32, a, n)[:] = cam.seq_lens_cpu
            width = cam.block_table_cpu.shape[1]
            if width > lay.widths[a]:
                raise RuntimeError(f"CUDA graphs: group {gi} table width {width} > {lay.widths[a]}")
            lay.table(h32, a, n)[:, :width] = cam.block_table_cpu
        for m, gi in enumerate(lay.mamba):
            built = inputs[gi]
            assert isinstance(built, MambaInputs)
            lay.state_slots(h64, m, n)[:] = built.state_indices.numpy()
        if sources is not None:
            lay.sources(h64, n)[:] = sources
        self._fill_padding(n)
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        self._copied.record()
        if sources is not None:
            assert prev_tokens is not None
            ids = lay.ids(self._dev64, n)
            ids.copy_(take_pending(ids, lay.sources(self._dev64, n), prev_tokens))
        graph, logits, _ = self._graphs[b]
        graph.replay()
        return logits[:n]

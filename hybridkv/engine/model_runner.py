"""One model step: host batch -> per-group metadata -> builders -> forward context -> logits.

The runner owns the cache tensors (bound once to the layers) and nothing about scheduling: the
scheduler decides which tokens run and which blocks / state slots they use; the runner turns that
into one ``CommonAttentionMetadata`` per group, lets each group's builder transform it, and runs the
model under a forward context. Host work is vectorised numpy; the only device transfers are the
step's small index arrays. Under tensor parallelism every rank runs one of these on its model shard and
its own cache shard, with the same batch (``engine/executor.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hybridkv.backends.builders import AttentionInputs, MambaInputs, build_group_inputs, build_mamba_inputs
from hybridkv.backends.registry import KernelBackend, UnsupportedConfig, get_backend
from hybridkv.engine.cuda_graphs import DecodeGraphs, DecodeTables, default_buckets
from hybridkv.engine.host_checkpoints import HostCheckpoints
from hybridkv.engine.mixed_graphs import (
    HEAD_MIN_ROWS,
    MixedStepGraphs,
    eager_sizes,
    mixed_buckets,
    padded_rows,
    unsupported_for_mixed_graphs,
)
from hybridkv.engine.mixed_metadata import MixedStepBuffers, static_groups, static_state_groups
from hybridkv.engine.sampler import take_pending
from hybridkv.forward_context import ForwardContext, forward_context
from hybridkv.kv_groups.cache_tensors import allocate_kv_cache
from hybridkv.kv_groups.plan import KVCachePlan, plan_kv_cache
from hybridkv.metadata import CommonAttentionMetadata, debug_enabled, host_to_device, host_to_device_many
from hybridkv.models.hybrid import HybridModel
from hybridkv.utils import format_bytes

logger = logging.getLogger("hybridkv.engine")
_max = np.maximum.reduce        # a direct ufunc reduction: ndarray.max goes through a Python wrapper


@dataclass(frozen=True, kw_only=True, eq=False)
class StepTables(Sequence[np.ndarray]):
    """``StepBatch.block_tables`` as the engine hands them over, in the form the coordinator keeps them:
    per plan group the rows the step reads, an early-freeing group's (sliding window, chunked local)
    starting at its first live block (``starts[g]``, (num_reqs,) int32; None = column 0), and each
    attention group's (num_tokens,) int64 KV slot mapping. ``ModelRunner`` reads these as they are: no
    re-gather, no transform work. Indexing or iterating gives the plain logical tables of the StepBatch
    contract, (num_reqs, width) each, built on demand (the tensor-parallel broadcast, any other reader)."""

    tables: Sequence[np.ndarray]           # per group, (num_reqs, *) int32 from column starts[g]
    starts: Sequence[np.ndarray | None]    # per group, (num_reqs,) int32 first logical block, or None
    slots: Sequence[np.ndarray | None]     # per group, (num_tokens,) int64 (None for Mamba groups)
    width: int                             # columns of the logical attention tables

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, group: int) -> np.ndarray:  # type: ignore[override]
        table, start = self.tables[group], self.starts[group]
        if start is None:
            return table
        rows, cols = np.nonzero(table)                   # a row's entries past its keys are null
        out = np.zeros((table.shape[0], self.width), np.int32)
        out[rows, start[rows] + cols] = table[rows, cols]
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[g] for g in range(len(self)))


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """What the scheduler decided for one step, host side, requests in batch order (decodes first).

    ``block_tables[g]`` is group g's (num_reqs, width) table: block ids for attention groups (null 0),
    the working state slot in column 0 for Mamba groups. The engine passes a ``StepTables``.

    With asynchronous scheduling some input tokens are still on the device, sampled by the step in
    flight: ``input_sources[t] >= 0`` takes token t from ``prev_tokens`` (an in-process runner only)."""

    input_ids: np.ndarray                  # (num_tokens,) int64
    query_lens: np.ndarray                 # (num_reqs,) tokens computed this step
    seq_lens: np.ndarray                   # (num_reqs,) tokens known after this step (computed + new)
    block_tables: Sequence[np.ndarray]     # per group, (num_reqs, width) int32
    logits_indices: np.ndarray             # (num_outputs,) token indices whose logits are returned
    input_sources: np.ndarray | None = None   # (num_tokens,) int64 index into prev_tokens, -1 = input_ids
    prev_tokens: torch.Tensor | None = None   # (S,) int64 on the device
    greedy: bool = False                   # every output row samples greedily: return their argmax too
    needs_logits: bool = True              # False (greedy only): the caller reads only the argmax

    @property
    def num_reqs(self) -> int:
        return int(self.query_lens.shape[0])

    def positions(self) -> np.ndarray:
        """(num_tokens,) absolute positions: num_computed + 0, 1, ... for each request."""
        q = self.query_lens.astype(np.int64)
        starts = np.cumsum(q) - q
        return np.arange(int(q.sum()), dtype=np.int64) + np.repeat(self.seq_lens - q - starts, q)


class _DecodeConstants:
    """What every decode step of ``n`` requests shares: query offsets 0..n (one query each), zero key
    starts and the request index 0..n-1, as views of buffers grown to the largest batch seen, with their
    device twins made once per device (and the views once per size). Shared by every step's CAMs, so
    like all CAM arrays: never mutate."""

    def __init__(self) -> None:
        self._size = 0
        self._views: dict[tuple[int, torch.device], tuple[np.ndarray, torch.Tensor, np.ndarray, torch.Tensor,
                                                          np.ndarray]] = {}

    def get(self, n: int, device: torch.device
            ) -> tuple[np.ndarray, torch.Tensor, np.ndarray, torch.Tensor, np.ndarray]:
        """(offsets (n+1,) int32, their device twin, zeros (n,) int32, their twin, arange (n,) int64)."""
        views = self._views.get((n, device))
        if views is None:
            if n + 1 > self._size:
                self._size = max(n + 1, 2 * self._size)
                self._offsets = np.arange(self._size, dtype=np.int32)
                self._zeros = np.zeros(self._size, np.int32)
                self._index = np.arange(self._size, dtype=np.int64)
                self._twins: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
                self._views = {}
            twins = self._twins.get(device)
            if twins is None:
                twins = self._twins[device] = (host_to_device(self._offsets, device),
                                               host_to_device(self._zeros, device))
            views = self._views[(n, device)] = (self._offsets[:n + 1], twins[0][:n + 1], self._zeros[:n],
                                                twins[1][:n], self._index[:n])
        return views


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """A step's results on the device: fp32 ``logits`` (num_outputs, vocab_size) at the batch's
    ``logits_indices`` (None for a batch that said it ``needs_logits`` not: a captured step then skips their
    write, 4 bytes x vocabulary per row) and, for a ``greedy`` batch, ``greedy`` (num_outputs,) int64, their
    argmax, with ``report``, the same tokens as the host should read them (``sampler.NONFINITE`` where the
    chosen logit is not finite). A captured graph's outputs are its buffers: valid until the next step runs."""

    logits: torch.Tensor | None
    greedy: torch.Tensor | None = None
    report: torch.Tensor | None = None


class StepRunner(Protocol):
    """What the engine drives each step: ``ModelRunner`` in-process, or the tensor-parallel executor
    (``engine/executor.py``) that runs a ``ModelRunner`` on every rank."""

    plan: KVCachePlan

    def execute(self, batch: StepBatch) -> StepOutput | None: ...

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def host_moves_available(self) -> int:
        """Checkpoints ``copy_states`` can move to host memory now without waiting for earlier moves."""
        ...


class ModelRunner:
    """``cuda_graphs``: capture decode steps (``engine/cuda_graphs.py``) for batch sizes up to
    ``max_num_seqs``, and the other steps in pieces (``engine/mixed_graphs.py``) up to ``max_num_batched_tokens``
    tokens where every layer allows it; None = when the device is CUDA and the backend allows it (logged either
    way)."""

    def __init__(self, model: HybridModel, plan: KVCachePlan, *, backend: str | KernelBackend = "auto",
                 cuda_graphs: bool | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048) -> None:
        self.model = model
        self.plan = plan
        self.max_num_seqs = max_num_seqs
        self.device = next(model.parameters()).device
        self.backend = backend if isinstance(backend, KernelBackend) else get_backend(backend, self.device)
        model.fuse_projections()            # q|k|v and gate|up as one GEMM each (parameters become views)
        # Inference only: without this, forwards outside ``execute``'s inference mode (the graph captures, the
        # start-up's GEMM touches) record autograd graphs and keep their activations alive.
        model.requires_grad_(False)
        try:
            self.caches = allocate_kv_cache(plan, device=self.device)
        except torch.OutOfMemoryError as e:
            raise MemoryError(out_of_memory_message("the KV cache", plan.allocated_bytes, self.device)) from e
        self.host_checkpoints: HostCheckpoints | None = None
        if plan.num_host_checkpoint_slots:
            try:
                self.host_checkpoints = HostCheckpoints(plan, self.caches, self.device)
            except torch.OutOfMemoryError as e:     # the device staging rows
                raise MemoryError(out_of_memory_message("the host checkpoints' staging rows",
                                                        plan.num_staging_slots * plan.state_bytes_per_slot,
                                                        self.device)) from e
            except RuntimeError as e:    # (allocating or page-locking the host rows)
                raise MemoryError(f"could not allocate {format_bytes(plan.host_checkpoint_bytes)} of host memory "
                                  f"for prefix-cache checkpoints ({e}); lower host_cache_memory") from e
            logger.info("prefix cache: %d recurrent-state checkpoint slots in host memory (%s)",
                        plan.num_host_checkpoint_slots, format_bytes(plan.host_checkpoint_bytes))
        layers = model.cache_layers()
        if set(layers) != set(self.caches):
            raise ValueError(f"plan and model disagree on cache layers: plan-only "
                             f"{sorted(set(self.caches) - set(layers))[:4]}, model-only "
                             f"{sorted(set(layers) - set(self.caches))[:4]}")
        attention = {name for g in plan.attention_groups for name in g.cache_names}   # KV-sharing readers too
        for name, module in layers.items():
            tensors = self.caches[name]
            if name in attention:                     # (num_blocks, planes, block_size, kv_heads, dim): K and V, or
                # MLA's one latent plane
                module.bind_cache(*tensors[0].unbind(1))
            else:                                     # state slots: one tensor per state
                module.bind_cache(*tensors)
        self._decode_constants = _DecodeConstants()
        reason = self._graphs_unsupported()
        self.graphs = self._capture_graphs(cuda_graphs, max_num_seqs, reason)
        self.mixed_graphs = (self._capture_mixed(max_num_batched_tokens)
                             if cuda_graphs is not False and reason is None else None)

    def _graphs_unsupported(self) -> str | None:
        """Why no CUDA graph can run here; None when they can."""
        if self.device.type != "cuda":
            return f"the device is {self.device.type}"
        if not self.backend.cuda_graph_safe:
            return f"kernel backend {self.backend.name!r} reads host metadata inside its ops"
        if self.model.tp.size > 1:
            return "tensor parallelism is not supported with CUDA graphs yet"
        return None

    def _capture_graphs(self, wanted: bool | None, max_num_seqs: int, reason: str | None) -> DecodeGraphs | None:
        if wanted is False:
            return None
        if reason is not None:
            if wanted:
                raise ValueError(f"cuda_graphs=True: {reason}")
            logger.info("CUDA graphs off: %s", reason)
            return None
        graphs = DecodeGraphs(self.model, self.plan, self.backend, buckets=default_buckets(max_num_seqs))
        try:
            graphs.capture()
        except (RuntimeError, UnsupportedConfig, ValueError) as e:   # an op that syncs or refuses this config
            # (ValueError: a reference op refusing the padded rows' shared null state slot, e.g. Mamba-1's update)
            if wanted:
                raise RuntimeError(f"cuda_graphs=True: capturing the decode step failed: {e}") from e
            logger.warning("CUDA graphs off: capturing the decode step failed (%s)", str(e).splitlines()[0])
            return None
        return graphs

    def _capture_mixed(self, max_num_batched_tokens: int) -> MixedStepGraphs | None:
        """The mixed-step graphs (whether or not the decode graphs captured: their metadata ops run eagerly, so a
        model whose decode step cannot be captured still runs its other steps in pieces)."""
        reason = unsupported_for_mixed_graphs(self.model)
        if reason is not None:
            logger.info("CUDA graphs for mixed steps off: %s", reason)
            return None
        state_groups = static_state_groups(self.plan, self.model.cache_layers())
        graphs = self._mixed_graphs(max_num_batched_tokens, state_groups)
        # a vendor scan that refuses a capture (mamba_ssm's reads the lengths on the host): those layers break the graph
        if isinstance(graphs, UnsupportedConfig) and state_groups:
            logger.info("the mixed graphs keep the state groups as graph breaks: %s", graphs)
            graphs = self._mixed_graphs(max_num_batched_tokens, ())
        if not isinstance(graphs, MixedStepGraphs):
            logger.warning("CUDA graphs for mixed steps off: capturing failed (%s)", str(graphs).splitlines()[0])
            return None
        rows = range(HEAD_MIN_ROWS + 1, self.max_num_seqs + 1)
        try:
            graphs.touch_eager_sizes(self.model.compute_logits_and_greedy,
                                     sorted({padded_rows(r, self.max_num_seqs) for r in rows}))
        except (RuntimeError, UnsupportedConfig) as e:    # (out of memory among them): only a first-use cost lost
            logger.warning("start-up could not run the eager step sizes' GEMMs (%s): the first steps of each size "
                           "will pay cuBLAS's first use", str(e).splitlines()[0])
        return graphs

    def _mixed_graphs(self, max_num_batched_tokens: int, state_groups: Sequence[int]
                      ) -> MixedStepGraphs | RuntimeError | UnsupportedConfig | KeyError:
        """The mixed graphs captured with full and sliding-window attention and the ``state_groups`` inside, or why
        the capture failed."""
        buckets = mixed_buckets(max_num_batched_tokens)
        static = None
        if static_groups(self.plan) or state_groups:
            static = MixedStepBuffers(self.plan, max_tokens=buckets[-1], max_reqs=min(buckets[-1], self.max_num_seqs),
                                      device=self.device, pin=True, state_groups=state_groups)
        graphs = MixedStepGraphs(self.model, self.backend, buckets=buckets, eager=eager_sizes(max_num_batched_tokens),
                                 static=static)
        try:
            graphs.capture()
        except (RuntimeError, UnsupportedConfig, KeyError) as e:   # an op that syncs or refuses this config,
            return e    # or a layer that reads step inputs outside metadata_op (KeyError: the capture gives it none)
        return graphs

    def build_context(self, batch: StepBatch, extra: Sequence[np.ndarray] = (),
                      static: MixedStepBuffers | None = None) -> tuple[ForwardContext, list[torch.Tensor]]:
        """One CAM per group from the batch, then each group's builder; all layers of a group share it. ``extra``:
        more host arrays the step needs on the device, whose twins come back with the context (same copy).
        ``static``: its groups are packed and copied there instead (the context has no inputs for them)."""
        built, twins = self._group_inputs(batch, self.device, extra, static)
        inputs: dict[str, AttentionInputs | MambaInputs] = {}
        for group, group_built in zip(self.plan.groups, built, strict=True):
            if group_built is not None:
                inputs.update(dict.fromkeys(group.cache_names, group_built))
        return ForwardContext(inputs=inputs, backend=self.backend), twins

    def group_inputs(self, batch: StepBatch, device: torch.device) -> list[AttentionInputs | MambaInputs]:
        """Per plan group: its CAM from the batch, transformed by its builder, device twins on ``device``."""
        return self._group_inputs(batch, device, ())[0]

    def _group_inputs(self, batch: StepBatch, device: torch.device, extra: Sequence[np.ndarray],
                      static: MixedStepBuffers | None = None
                      ) -> tuple[list[AttentionInputs | MambaInputs | None], list[torch.Tensor]]:
        """``group_inputs``, and the device twins of ``extra`` made by the same copy; with ``static``, its groups'
        fields are packed there and copied (their entries None).

        The batch-wide arrays (offsets, lengths) are made once; each group adds its block table and slot
        mapping, and every device twin of the step comes from one packed copy (a Gemma-3-like model has 13
        groups: ~55 arrays). A ``StepTables`` batch brings the tables ready (an early-freeing group's
        rows already start at their first live block, so its transform finds nothing left to do). A
        decode batch (one query per request) makes no offsets anew: they are views of
        ``_DecodeConstants``. The scheduler's output is trusted here (``CommonAttentionMetadata.build`` is
        the checked path; HYBRIDKV_DEBUG validates)."""
        if static is not None and debug_enabled():     # its groups build no CAM: validate the same arrays as CAMs
            self._group_inputs(batch, torch.device("cpu"), ())
        q, s = batch.query_lens, batch.seq_lens
        n, num_tokens = int(q.shape[0]), int(batch.input_ids.shape[0])
        s32 = s.astype(np.int32)
        uploads: list[np.ndarray] = []          # device twins made with one copy (``host_to_device_many``)

        def upload(a: np.ndarray) -> int:
            uploads.append(a)
            return len(uploads) - 1

        if n and num_tokens == n and _max(q) == 1:          # decode: n queries, one per request
            qsl, qsl_dev, zeros, zeros_dev, token_req = self._decode_constants.get(n, device)
            num_computed = s32 - 1
            max_query_len = 1
            batch_twins = None
        else:
            qsl = np.zeros(n + 1, np.int32)
            np.cumsum(q, out=qsl[1:])
            zeros = np.zeros(n, np.int32)
            batch_twins = (upload(qsl), upload(zeros))
            token_req = np.repeat(np.arange(n, dtype=np.int64), q)
            num_computed = s32 - q.astype(np.int32)
            max_query_len = int(_max(q)) if n else 0
        max_seq_len = int(_max(s32)) if n else 0
        s_up = upload(s32)
        prepared = batch.block_tables if isinstance(batch.block_tables, StepTables) else None
        positions = None if prepared is not None else batch.positions()    # (num_tokens,) int64
        index_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        static_ids = set(static.groups) if static is not None else set()
        static_state_ids = set(static.state_groups) if static is not None else set()
        packed: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []        # the static groups' (seq, table, slots)
        packed_states: list[tuple[np.ndarray, np.ndarray]] = []             # the static state groups' (slot, started)
        # pass 1: every group's host arrays (what needs a device twin goes to ``uploads``)
        rows: list[tuple | str | None] = []
        for g, group in enumerate(self.plan.groups):
            spec = group.spec
            table = batch.block_tables[g] if prepared is None else prepared.tables[g]
            if not spec.is_attention:                        # column 0: the working state slot
                if g in static_state_ids:
                    packed_states.append((table[:, 0], num_computed > 0))
                    rows.append("static")
                else:
                    rows.append(None)
                continue
            bs = spec.block_size
            table = np.ascontiguousarray(table, dtype=np.int32)
            if prepared is None:
                key = (bs, table.shape[1])
                if key not in index_cache:       # attention groups share these: same positions, same width
                    assert positions is not None
                    index_cache[key] = (token_req * table.shape[1] + positions // bs, positions % bs)
                flat, offset = index_cache[key]
                slots = np.multiply(table.ravel().take(flat), bs, dtype=np.int64)
                slots += offset
                start = None
            else:
                slots, start = prepared.slots[g], prepared.starts[g]
            if g in static_ids:
                packed.append((s32 if start is None else s32 - start * bs, table, slots))
                rows.append("static")
                continue
            if start is None:
                seq, computed, key_start, max_seq, twins = s32, num_computed, zeros, max_seq_len, None
            else:                                            # relative to each row's first live block
                key_start = start * bs
                seq = s32 - key_start
                computed = num_computed - key_start
                max_seq = int(_max(seq))
                twins = (upload(seq), upload(key_start))
            on_device = _pad_columns(table) if device.type == "cuda" else table
            rows.append((table, slots, seq, computed, key_start, max_seq, twins, upload(on_device), upload(slots)))
        num_group_uploads = len(uploads)
        if static is not None:
            bucket = self.mixed_graphs.bucket_for(num_tokens) if self.mixed_graphs is not None else None
            if bucket is None:
                raise RuntimeError(f"static step inputs for a {num_tokens}-token step that no mixed graph runs")
            static.pack(qsl, packed, bucket=bucket, states=packed_states)
            static.upload()
            if not extra and static.covers_plan:        # nothing else goes over
                return [None] * len(rows), []
        dev = host_to_device_many([*uploads, *extra], device)
        if batch_twins is not None:
            qsl_dev, zeros_dev = dev[batch_twins[0]], dev[batch_twins[1]]
        s_dev = dev[s_up]
        # pass 2: the CAMs and each group's builder
        out: list[AttentionInputs | MambaInputs | None] = []
        debug = debug_enabled()
        for g, (group, row) in enumerate(zip(self.plan.groups, rows, strict=True)):
            spec = group.spec
            if row == "static":
                out.append(None)
                continue
            if row is None:
                table = batch.block_tables[g] if prepared is None else prepared.tables[g]
                out.append(build_mamba_inputs(query_start_loc=qsl_dev, query_start_loc_cpu=qsl,
                                              num_computed_tokens_cpu=num_computed, max_query_len=max_query_len,
                                              state_slots_cpu=table[:, 0]))
                continue
            table, slots, seq, computed, key_start, max_seq, twins, table_up, slots_up = row
            seq_dev, key_start_dev = (s_dev, zeros_dev) if twins is None else (dev[twins[0]], dev[twins[1]])
            cam = CommonAttentionMetadata(
                query_start_loc=qsl_dev, query_start_loc_cpu=qsl, seq_lens=seq_dev, seq_lens_cpu=seq,
                num_computed_tokens_cpu=computed, key_start=key_start_dev, key_start_cpu=key_start,
                block_table_tensor=dev[table_up], block_table_cpu=table, slot_mapping=dev[slots_up],
                block_size=spec.block_size, num_reqs=n, num_actual_tokens=num_tokens, max_query_len=max_query_len,
                max_seq_len=max_seq)
            if debug:
                cam.validate()
            out.append(build_group_inputs(spec, cam))
        return out, dev[num_group_uploads:]

    def _graph_eligible(self, batch: StepBatch) -> bool:
        """A decode batch the captured graphs can run: one continuing token per request, logits for all."""
        n = batch.num_reqs
        return (self.graphs is not None and 0 < n <= self.graphs.buckets[-1]
                and batch.input_ids.shape[0] == n and batch.logits_indices.shape[0] == n
                and _max(batch.query_lens) == 1 and bool((batch.seq_lens > 1).all()))

    def graph_inputs(self, batch: StepBatch) -> DecodeTables | list[AttentionInputs | MambaInputs]:
        """What ``DecodeGraphs.run`` packs for a graph-eligible ``batch``: the engine's ``StepTables`` as
        they are (packed with a few numpy ops per group), else the eager path's host-side group inputs."""
        tables = batch.block_tables
        if isinstance(tables, StepTables):
            return DecodeTables(seq_lens=batch.seq_lens, tables=tables.tables, starts=tables.starts,
                                slots=tables.slots)
        return self.group_inputs(batch, torch.device("cpu"))

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput | None:
        """Run one step; returns fp32 logits (num_outputs, vocab_size) at ``batch.logits_indices`` (and their
        argmax for a greedy batch; only the argmax for a greedy batch that ``needs_logits`` not), on the device and
        valid in stream order until the next step runs (a graph's outputs are overwritten by its next replay). On a
        tensor-parallel rank other than 0 the logits go to rank 0 and this returns None."""
        if self._graph_eligible(batch):
            assert self.graphs is not None
            logits, greedy, reported = self.graphs.run(
                np.asarray(batch.input_ids, np.int64), batch.seq_lens - 1, self.graph_inputs(batch),
                sources=batch.input_sources, prev_tokens=batch.prev_tokens,
                logits=batch.needs_logits or not batch.greedy)
            return StepOutput(logits=logits, greedy=greedy, report=reported)
        index = np.asarray(batch.logits_indices, dtype=np.int64)
        rows = len(index)
        if self.mixed_graphs is not None:   # the head's GEMM at a few row counts (mixed_graphs.HEAD_GRANULE)
            index = np.pad(index, (0, padded_rows(rows, self.max_num_seqs) - rows), mode="edge")
        ids, positions = np.asarray(batch.input_ids, dtype=np.int64), batch.positions()
        static = self._static_inputs(batch)
        if static is not None:              # the step's inputs ride in the static buffers' one copy
            mixed = self.mixed_graphs
            assert mixed is not None
            head_graph = 0 < rows <= mixed.head_rows
            static.pack_step(ids, positions, batch.input_sources, index,
                             write_logits=batch.needs_logits or not batch.greedy)
            context, _ = self.build_context(batch, (), static)
            with forward_context(context):  # (the graph breaks' ops read it)
                hidden = mixed.replay_static(len(ids), batch.prev_tokens if batch.input_sources is not None else None)
            if head_graph:
                return _head_output(batch, rows, *mixed.run_head())
            index_dev = static.head_rows(len(index))
        else:
            arrays = [ids, positions, index, *(() if batch.input_sources is None else (batch.input_sources,))]
            context, (ids_dev, pos_dev, index_dev, *sources) = self.build_context(batch, arrays)   # one copy
            if sources:
                assert batch.prev_tokens is not None
                ids_dev = take_pending(ids_dev, sources[0], batch.prev_tokens)
            hidden = self._hidden(ids_dev, pos_dev, context)
        hidden = hidden.index_select(0, index_dev)
        with forward_context(context):      # the head too runs on the step's backend
            if batch.greedy:
                # the report comes from the argmax's own reduction (a separate finite check: three more launches)
                reported = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
                out = self.model.compute_logits_and_greedy(hidden, report=reported)
                return None if out is None else _head_output(batch, rows, *out, reported)
            logits = self.model.compute_logits(hidden)
        return None if logits is None else _head_output(batch, rows, logits)

    def _static_inputs(self, batch: StepBatch) -> MixedStepBuffers | None:
        """The mixed graphs' static step inputs when this step replays them: a bucket holds its tokens, the static
        groups' tables fit (``MixedStepBuffers.fits``) and so do the step in flight's tokens; else None (the step
        runs eagerly)."""
        mixed = self.mixed_graphs
        if mixed is None or mixed.static is None or mixed.bucket_for(int(batch.input_ids.shape[0])) is None:
            return None
        if batch.prev_tokens is not None and batch.prev_tokens.shape[0] > mixed.static.d_prev.shape[0]:
            return None     # (one token per request that sampled, at most max_num_seqs: a guard, not a case seen)
        tables = batch.block_tables.tables if isinstance(batch.block_tables, StepTables) else batch.block_tables
        widths = [tables[g].shape[1] for g in mixed.static.groups]
        return mixed.static if mixed.static.fits(batch.num_reqs, widths) else None

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """The forward of a step that neither a decode graph nor the mixed graphs over static inputs run: in pieces
        of graphs up to their largest bucket where they hold no static inputs, past it eagerly at a padded size
        (``MixedStepGraphs.run_eager``; also at the bucket's size when the graphs hold static inputs that the step
        does not fit, rare: a sliding window's rows wider than the window and the largest bucket), or plainly where
        there are no mixed graphs."""
        mixed = self.mixed_graphs
        if mixed is not None and mixed.bucket_for(int(ids.shape[0])) is None:
            return mixed.run_eager(ids, positions, context)
        if mixed is not None and mixed.static is not None:      # the step does not fit the static inputs
            return mixed.run_eager(ids, positions, context, size=mixed.bucket_for(int(ids.shape[0])))  # (GEMMs met)
        with forward_context(context):
            return self.model(ids, positions) if mixed is None else mixed.run(ids, positions)

    @torch.inference_mode()
    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy recurrent states slot src -> dst in every such layer (prefix-cache checkpoints); slots from
        ``plan.num_state_slots`` on are host-memory checkpoints (``HostCheckpoints``). Every source is read as
        it was before the batch: device -> host first (they read device slots the others write), device ->
        device as one gather + scatter, host -> device last (they write working slots the others may read; the
        state manager never has a host slot written and read in one batch)."""
        if not copies:
            return
        pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
        n = self.plan.num_state_slots
        from_host, to_host = pairs[:, 0] >= n, pairs[:, 1] >= n
        if (from_host & to_host).any():
            raise RuntimeError("copy_states: host -> host copies are never queued")
        if to_host.any():
            self.host_checkpoints.demote(pairs[to_host].tolist())
        local = pairs[~(from_host | to_host)]
        if local.size:
            # (an asynchronous copy: torch.tensor(..., device=cuda) waits for the device, and a step with
            # checkpoints would then lose its overlap with the step before it)
            src, dst = host_to_device(np.ascontiguousarray(local.T), self.device)
            for group in self.plan.mamba_groups:
                for name in group.layer_names:
                    for state in self.caches[name]:
                        state[dst] = state[src]
        if from_host.any():
            self.host_checkpoints.restore(pairs[from_host].tolist())

    def host_moves_available(self) -> int:
        return self.host_checkpoints.moves_available() if self.host_checkpoints is not None else 0


def _head_output(batch: StepBatch, rows: int, logits: torch.Tensor, greedy: torch.Tensor | None = None,
                 report: torch.Tensor | None = None) -> StepOutput:
    """The step's output from the head's (padded rows, ...) results: its first ``rows``; a greedy batch's argmax and
    report, and its logits only where ``needs_logits`` (a graph's may be unwritten otherwise)."""
    if not batch.greedy:
        return StepOutput(logits=logits[:rows])
    assert greedy is not None and report is not None
    return StepOutput(logits=logits[:rows] if batch.needs_logits else None, greedy=greedy[:rows], report=report[:rows])


def _pad_columns(table: np.ndarray) -> np.ndarray:
    """``table`` with null columns up to a multiple of 16: the Triton kernels specialize on the row stride, and
    a step's varying width would otherwise be padded on the device by every layer of the group."""
    extra = -table.shape[1] % 16
    if not extra:
        return table
    out = np.zeros((table.shape[0], table.shape[1] + extra), np.int32)
    out[:, :table.shape[1]] = table
    return out


def out_of_memory_message(what: str, asked: int | None, device: torch.device) -> str:
    """One line for an allocation that did not fit: what was asked (when known) and what the device has free."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    parts = [f"{format_bytes(asked)} asked" if asked is not None else None,
             f"{format_bytes(free)} free on {device}" if free is not None else f"device {device}"]
    return (f"out of memory allocating {what} ({', '.join(p for p in parts if p)}); lower kv_cache_memory "
            "(or max_model_len / max_num_seqs), or shard the model (tensor_parallel_size)")


def reference_logits(model: HybridModel, token_ids: Sequence[int], *, backend: str = "torch") -> torch.Tensor:
    """Logits at every position of one sequence from a single no-cache-reuse forward: a fresh private
    cache, the whole sequence as one prefill. The oracle the engine's incremental results must match."""
    if model.tp.size > 1:
        raise ValueError("reference_logits needs an unsharded model (tensor_parallel_size 1)")
    n = len(token_ids)
    block_size = model.config.default_block_size()
    blocks = -(-n // block_size)
    specs = model.config.kv_specs(block_size=block_size, kv_dtype=next(model.parameters()).dtype)
    page_sum = sum(s.bytes_per_block for s in specs.values() if s.is_attention)
    state_sum = sum(s.bytes_per_block for s in specs.values() if not s.is_attention)
    budget = 2 * (page_sum * (blocks + 4) + state_sum * 4)
    plan = plan_kv_cache(specs, max_model_len=max(n, 1), kv_memory=budget, max_num_seqs=1, step_tokens=n)
    runner = ModelRunner(model, plan, backend=backend, cuda_graphs=False)   # one prefill: nothing to replay
    # Attention groups share the pool (a block id names a page in every group's tensors): disjoint ids.
    tables = []
    for g, group in enumerate(plan.groups):
        ids = np.arange(1 + g * blocks, 1 + (g + 1) * blocks, dtype=np.int32)[None, :]
        tables.append(ids if group.spec.is_attention else np.ones((1, 1), np.int32))
    batch = StepBatch(input_ids=np.asarray(token_ids, np.int64), query_lens=np.array([n]),
                      seq_lens=np.array([n]), block_tables=tables, logits_indices=np.arange(n))
    out = runner.execute(batch)
    assert out is not None
    return out.logits

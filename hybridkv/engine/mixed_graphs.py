"""CUDA graphs for mixed steps (prefills, with or without decodes), captured in pieces.

Under serving traffic nearly every step is mixed: a new request arrives before the running ones finish, so
its prefill shares the step with their decodes. Run eagerly, such a step of a ~1B model costs ~19 ms of host
time (a few hundred kernel launches through Python) for ~3-5 ms of GPU work (``benchmarks/gpu_step_phases.py
--mixed``), and every running request waits that long for its next token. Decode steps replay whole-step
graphs (``cuda_graphs.py``); a mixed step cannot, since its attention and state updates depend on how its
tokens split into requests. Everything else in the forward depends on the token count only, and each layer
keeps its step-dependent part inside ``metadata_op`` (attention with its KV writes, state-slot updates). So
per token-count bucket the forward is captured as a chain of graphs broken at those calls, and replayed with
the calls run eagerly in between on the step's real tokens (vLLM's piecewise graphs, with the breaks where
the layers say instead of a compiler's graph split):

    ids, positions -> the static inputs (padded rows keep earlier, valid values; with ``MixedStepBuffers`` they are
                      its views, packed with the rest of the step, and graph 0 takes the pending ids itself)
    graph 0 | op 0 (eager: n real tokens) -> break buffer | graph 1 | op 1 -> break buffer | ... | graph L
    -> hidden (bucket rows); the caller takes the first n
    (with ``MixedStepBuffers``: the last graph also gathers the first 64 head rows' hidden states into the head graph's
    input, and a step that wants logits for at most 64 rows replays that graph, ``run_head``; else the head runs
    eagerly on the rows it needs)

Full and sliding-window attention and Mamba2 break nothing: their op reads static inputs that the step packs before
the replay (``mixed_metadata.py``), so it is captured with the rest, and a Gemma-3-like model's mixed step is one
graph (3.4 ms for 64 decodes + 256 prompt tokens on an H200, ~GPU time; 22 ms with an eager op per attention
layer). The breaks left are the other recurrent kinds', MLA's and chunked-local attention's.

Padded rows run through the graphs on stale ids and stale op outputs (finite rows from the static ops: the padded
tokens belong to a request with no keys and no state); no captured op lets a padded row change a real row's value (an op
that mixes rows, such as MoE routing, still computes each row on its own), and nothing reads them. A
``metadata_op`` result is used before the second call after it (its contract), so the breaks take turns over two
buffers per dtype, shared by every bucket: a few MB, where a buffer per break would hold layers x 4096 tokens x
width.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.backends.registry import KernelBackend
from hybridkv.engine.mixed_metadata import HEAD_ROWS_UNIT, MixedStepBuffers
from hybridkv.engine.sampler import take_pending
from hybridkv.forward_context import ForwardContext, forward_context
from hybridkv.models.hybrid import HybridModel

logger = logging.getLogger("hybridkv.engine")

MAX_GRAPHED_TOKENS = 4096
"""Steps with more tokens run eagerly: their GPU time hides the host's (a ~1B model's 4096-token step is ~15 ms
of matmuls)."""

EAGER_GRANULE = 256
"""Eager steps run at a padded token count (``eager_sizes``), a multiple of at least this many tokens. cuBLAS
chooses (and builds) its kernel for a GEMM shape on the shape's first use: ~0.85 ms of host time per shape on an
H200 (``benchmarks/gpu_gemm_first_use.py``: the Gemma-3-like linears at 4097-33791 rows, 3.6 ms per step of four
shapes first, 0.28 ms after), while the GPU waits. At exact token counts every eager step of a first pass met new
shapes; padded, there are few sizes and the start-up meets each of them (``MixedStepGraphs.touch_eager_sizes``)."""

HEAD_GRANULE = HEAD_ROWS_UNIT
"""The logits head's rows past ``HEAD_MIN_ROWS`` are padded to a multiple of this, up to ``max_num_seqs``: the same
first-use cost, for each number of rows that wants logits in a step."""

HEAD_MIN_ROWS = 64
"""Rows up to which a vocabulary-wide head runs as the Triton GEMV (``triton_linear.SMALL_MAX_ROWS``): no cuBLAS
shape to meet."""

HEAD_GRAPH_ROWS = HEAD_MIN_ROWS
"""With static step inputs a step with at most this many logits rows runs the head as one graph of this many rows
(the GEMV's row tile is 64 from 33 rows up, and it reads the weight once for all of them), instead of its launches
through Python: ~0.2 ms of host time a mixed step on an H200's host (``benchmarks/gpu_mixed_step.py``). At most
``HEAD_ROWS_UNIT``: ``MixedStepBuffers.pack_step`` keeps that many head rows valid for every bucket's gather."""


def mixed_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Token counts captured: 16, 32, 64, then every 32 to 256, every 64 to 512, every 128 to 1024, every 256 to
    2048, every 512 to 4096, up to the step budget: past 128 tokens at most a fifth of a step is padding (the
    GEMMs run the padded rows; short mixed steps, a few decodes and a prompt chunk, are the common ones)."""
    top = min(max_num_batched_tokens, MAX_GRAPHED_TOKENS)
    sizes = [16, 32, 64, *range(96, 257, 32), *range(320, 513, 64), *range(640, 1025, 128), *range(1280, 2049, 256),
             *range(2560, 4097, 512)]
    return tuple(sorted({s for s in sizes if s < top} | {top}))


def eager_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Token counts eager steps are padded to: past ``MAX_GRAPHED_TOKENS``, multiples of a granule of
    ``EAGER_GRANULE`` or the power of two at most 1/32 of the size, whichever is larger (256 tokens up to 16384,
    512 up to 32768, and so on: at most 6% padding, at 4097 tokens, and under ~3% past 8192), and the step budget
    itself last."""
    sizes, n = [], MAX_GRAPHED_TOKENS
    while n < max_num_batched_tokens:
        granule = max(EAGER_GRANULE, 1 << max(0, (n // 32).bit_length() - 1))
        n = min(max_num_batched_tokens, (n // granule + 1) * granule)
        sizes.append(n)
    return tuple(sizes)


def padded_rows(rows: int, max_num_seqs: int) -> int:
    """The logits head's row count for ``rows`` rows: unchanged up to ``HEAD_MIN_ROWS`` or past ``max_num_seqs``
    (prompt logprobs: rare), else the next multiple of ``HEAD_GRANULE`` (capped there)."""
    if rows <= HEAD_MIN_ROWS or rows > max_num_seqs:
        return rows
    return min(max_num_seqs, -(-rows // HEAD_GRANULE) * HEAD_GRANULE)


def unsupported_for_mixed_graphs(model: HybridModel) -> str | None:
    """Why the model's forward cannot be captured in pieces; None when it can."""
    if model.tp.size > 1:
        return "tensor parallelism is not supported with CUDA graphs yet"
    for name, module in model.cache_layers().items():
        if not getattr(module, "graph_breaks", False):
            return f"layer {name} ({type(module).__name__}) does not keep its step inputs inside metadata_op"
    return None


@dataclass(frozen=True)
class _Break:
    """One ``metadata_op`` of the captured forward: ``fn`` on ``tensors`` (graph outputs, bucket rows), its
    result copied into ``out`` (a view of the shared break buffer) for the next graph to read."""

    fn: Callable[..., torch.Tensor]
    tensors: tuple[torch.Tensor, ...]
    out: torch.Tensor

    def run(self, n: int) -> None:
        result = self.fn(*(t[:n] for t in self.tensors))
        out = self.out[:n]
        out.copy_(result.reshape(out.shape))


class _Recorder:
    """The forward context's ``graph_breaks`` while one bucket is captured (with no ``pool``: warmed up outside a
    capture): each ``metadata_op`` ends the graph being captured, is recorded, and starts the next."""

    def __init__(self, owner: MixedStepGraphs, pool: tuple[int, int] | None) -> None:
        self.owner, self.pool = owner, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def start(self) -> None:
        if self.pool is not None:
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self.pool)

    def stop(self) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            graph.capture_end()
            self.graphs.append(graph)

    def __call__(self, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...],
                 shape: tuple[int, ...], dtype: torch.dtype, key: str | None = None) -> torch.Tensor:
        if key is not None and key in self.owner.static_names:
            return fn(*tensors)         # captured: it reads the static inputs (``mixed_metadata.py``)
        self.stop()
        out = self.owner.break_buffer(shape, dtype, turn=len(self.breaks) % 2)
        self.breaks.append(_Break(fn, tensors, out))
        self.start()
        return out


class _Padded:
    """The forward context's ``graph_breaks`` for an eager step run at a padded token count: each ``metadata_op``
    runs on the ``n`` real tokens and its result is padded with zero rows (finite: every op after it is row-wise)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...],
                 shape: tuple[int, ...], dtype: torch.dtype, key: str | None = None) -> torch.Tensor:
        result = fn(*(t[:self.n] for t in tensors)).reshape(self.n, *shape[1:])
        return F.pad(result, (0, 0) * (len(shape) - 1) + (0, shape[0] - self.n))


def _zeros(fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], shape: tuple[int, ...],
           dtype: torch.dtype, key: str | None = None) -> torch.Tensor:
    """``graph_breaks`` that skips every ``metadata_op`` (zeros instead): the rest of a forward, with no step."""
    return torch.zeros(shape, dtype=dtype, device=tensors[0].device)


class MixedStepGraphs:
    """The model's forward captured in pieces per token-count bucket, over static inputs and one memory pool; and
    the larger steps run eagerly at padded token counts (``eager_sizes``)."""

    def __init__(self, model: HybridModel, backend: KernelBackend, *, buckets: Sequence[int],
                 eager: Sequence[int] = (), static: MixedStepBuffers | None = None) -> None:
        if not backend.cuda_graph_safe:
            raise ValueError(f"kernel backend {backend.name!r} reads host metadata inside its ops; "
                             "CUDA graphs need one that reads device metadata only (e.g. 'triton')")
        reason = unsupported_for_mixed_graphs(model)
        if reason is not None:
            raise ValueError(f"mixed-step CUDA graphs: {reason}")
        self.model, self.backend = model, backend
        self.device = next(model.parameters()).device
        self.buckets = tuple(sorted(set(buckets)))
        self.eager = tuple(sorted(set(eager)))
        # the layers whose metadata op is captured over static inputs, the step's inputs among them (the caller packs
        # them before ``replay_static``)
        self.static = static
        self.static_names = static.names if static is not None else frozenset()
        if static is not None and static.max_tokens < self.buckets[-1]:
            raise ValueError(f"static step inputs hold {static.max_tokens} tokens, the buckets {self.buckets[-1]}")
        top = self.buckets[-1]
        if static is None:          # (else the forward reads the static step inputs)
            self._ids = torch.zeros(top, dtype=torch.int64, device=self.device)
            self._positions = torch.zeros(top, dtype=torch.int64, device=self.device)
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._captured: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_Break], torch.Tensor]] = {}
        self._inputs: dict[int, Mapping[str, object]] = {}
        # the head graph's input: the hidden states of the step's first HEAD_GRAPH_ROWS head rows, gathered by every
        # bucket's last graph (static inputs only: the rows' indices ride in them); made by the first warm-up, in the
        # forward's output dtype (fp32 where the residual stream is)
        if static is not None and HEAD_GRAPH_ROWS > HEAD_ROWS_UNIT:
            raise ValueError(f"the head graph's {HEAD_GRAPH_ROWS} rows: at most the {HEAD_ROWS_UNIT} packed valid")
        self._head_in: torch.Tensor | None = None
        self._head: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def break_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, *, turn: int) -> torch.Tensor:
        """A ``shape`` view of break buffer ``turn`` (0 or 1) of ``dtype``, sized by the largest bucket (captured
        first; a larger request replaces it: the breaks recorded keep their views of the old one alive)."""
        numel = math.prod(shape)
        buf = self._buffers.get((dtype, turn))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(dtype, turn)] = torch.zeros(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool; each warmed up first outside a capture."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            if self.static is not None:     # the warm-up's static ops see a step of padding only (finite rows)
                self.static.pad(b)
            ids, positions = self._step_inputs(b)
            with forward_context(self._context(_Recorder(self, None), b)):
                self._gather_head_rows(self.model(ids, positions))     # compile and warm up outside the capture
            torch.cuda.synchronize(self.device)
            recorder = _Recorder(self, pool)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            context = self._context(recorder, b)
            with torch.cuda.stream(stream), forward_context(context):
                recorder.start()
                try:
                    ids, positions = self._step_inputs(b)      # (the pending ids taken inside the graph)
                    hidden = self.model(ids, positions)
                    self._gather_head_rows(hidden)
                finally:
                    recorder.stop()         # (after a failure too: the stream leaves capture mode)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._captured[b] = (recorder.graphs, recorder.breaks, hidden)
            self._inputs[b] = context.inputs    # what the captured attention may read stays alive (no cycle)
        if self.static is not None:
            self._capture_head(pool, stream)
        torch.cuda.synchronize(self.device)
        breaks = len(self._captured[self.buckets[-1]][1])
        logger.info("CUDA graphs captured for mixed steps of up to %d tokens (%d buckets, %d graph breaks each; the "
                    "logits head of up to %d rows: %s) in %.1f s", self.buckets[-1], len(self.buckets), breaks,
                    HEAD_GRAPH_ROWS, "a graph" if self._head is not None else "eager", time.perf_counter() - t0)

    def _gather_head_rows(self, hidden: torch.Tensor) -> None:
        """(captured at the end of every bucket) The first ``HEAD_GRAPH_ROWS`` head rows' hidden states -> the head
        graph's input (made here on the first call, a warm-up outside any capture)."""
        if self.static is None:
            return
        if self._head_in is None:
            self._head_in = hidden.new_zeros(HEAD_GRAPH_ROWS, hidden.shape[1])
        torch.index_select(hidden, 0, self.static.head_rows(HEAD_GRAPH_ROWS), out=self._head_in)

    def _capture_head(self, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        """The logits head over ``_head_in`` as one graph: fp32 logits (written where the static flag says), their
        argmax and its report, into buffers of its own. Failing (out of memory: the logits are 64 x vocabulary x 4
        bytes), the head stays eager."""
        assert self._head_in is not None and self.static is not None
        tokens = torch.zeros(HEAD_GRAPH_ROWS, dtype=torch.int64, device=self.device)
        report = torch.zeros_like(tokens)

        def head() -> tuple[torch.Tensor, torch.Tensor] | None:
            return self.model.compute_logits_and_greedy(self._head_in, out=tokens, report=report,
                                                        write_logits=self.static.d_flag)

        try:
            with forward_context(ForwardContext(inputs={}, backend=self.backend)):
                head()                                      # warm up outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        out = head()
                    finally:
                        graph.capture_end()
                torch.cuda.current_stream(self.device).wait_stream(stream)
        except RuntimeError as e:      # (torch.OutOfMemoryError among them)
            logger.warning("the mixed steps' logits head stays eager: capturing it failed (%s)", str(e).splitlines()[0])
            return
        assert out is not None          # (None only on tensor-parallel ranks, which capture no mixed graphs)
        self._head = (graph, out[0], tokens, report)

    @property
    def head_rows(self) -> int:
        """The most logits rows ``run_head`` serves (0: none, the head runs eagerly)."""
        return HEAD_GRAPH_ROWS if self._head is not None else 0

    def run_head(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After ``replay_static``: the logits head on the step's first ``head_rows`` head rows (``pack_step``), as one
        graph: fp32 logits (head_rows, vocab_size) (written only where ``pack_step`` asked), their argmax and its report
        (head_rows,) int64. Valid, in stream order, until the next replay: the logits sit in the graphs' shared pool,
        where the buckets keep their temporaries."""
        assert self._head is not None
        graph, logits, tokens, report = self._head
        graph.replay()
        return logits, tokens, report

    def touch_eager_sizes(self, head: Callable[[torch.Tensor], object], head_rows: Sequence[int]) -> None:
        """Meet every GEMM shape a padded eager step or the logits head can run (cuBLAS's first use of a shape,
        ``EAGER_GRANULE``): the forward without its metadata ops at each eager size, ``head`` on zero hidden
        states of each of ``head_rows`` rows."""
        t0 = time.perf_counter()
        with forward_context(ForwardContext(inputs={}, backend=self.backend, graph_breaks=_zeros)):
            for size in self.eager:
                zeros = torch.zeros(size, dtype=torch.int64, device=self.device)
                self.model(zeros, zeros)
            for rows in head_rows:
                head(torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.lm_head.weight.dtype,
                                 device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("start-up met the GEMM shapes of %d eager step sizes (%d-%d tokens) and %d head sizes in %.1f s",
                    len(self.eager), self.eager[0] if self.eager else 0, self.eager[-1] if self.eager else 0,
                    len(head_rows), time.perf_counter() - t0)

    def run_eager(self, ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext,
                  size: int | None = None) -> torch.Tensor:
        """Hidden states (n, hidden_size) of a step past the graphs, run eagerly under ``context`` at the padded
        size (``eager_sizes``, or ``size``: a bucket's, whose GEMMs the capture met) with its metadata ops on the n
        real tokens (``_Padded``)."""
        n = int(ids.shape[0])
        if size is None:
            size = next((s for s in self.eager if s >= n), n)
        if size == n:
            with forward_context(context):
                return self.model(ids, positions)
        pad = (0, size - n)
        with forward_context(dataclasses.replace(context, graph_breaks=_Padded(n))):
            return self.model(F.pad(ids, pad), F.pad(positions, pad))[:n]

    def _context(self, recorder: _Recorder, bucket: int) -> ForwardContext:
        # no step inputs but the static ones: a layer that reads them outside metadata_op fails here, at capture,
        # not silently later
        inputs = self.static.inputs(bucket) if self.static is not None else {}
        return ForwardContext(inputs=inputs, backend=self.backend, graph_breaks=recorder)

    def _step_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's (bucket,) ids and positions: the static step's (pending ids taken from ``d_prev``), else
        this object's own buffers (``run`` copies a step's there)."""
        static = self.static
        if static is None:
            return self._ids[:bucket], self._positions[:bucket]
        return take_pending(static.d_ids[:bucket], static.d_src[:bucket], static.d_prev), static.d_pos[:bucket]

    def bucket_for(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, hidden_size) of a step's (n,) ``ids`` at ``positions`` (both on the device), run
        under the step's forward context (the breaks read its inputs); valid until the next run."""
        assert self.static is None, "graphs over static step inputs replay with replay_static"
        n = int(ids.shape[0])
        self._ids[:n].copy_(ids)
        self._positions[:n].copy_(positions)
        return self._replay(n)

    def replay_static(self, num_tokens: int, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """``run`` for a step packed into the static buffers (``MixedStepBuffers.pack_step``, ``pack``, ``upload``):
        its pending ids come from ``prev_tokens`` (the step in flight's sampled tokens; None: none pending)."""
        assert self.static is not None
        if prev_tokens is not None:
            self.static.take_prev(prev_tokens)
        return self._replay(num_tokens)

    def _replay(self, n: int) -> torch.Tensor:
        b = self.bucket_for(n)
        assert b is not None, f"{n} tokens: more than the largest bucket ({self.buckets[-1]})"
        graphs, breaks, hidden = self._captured[b]
        for graph, brk in zip(graphs, [*breaks, None], strict=True):
            graph.replay()
            if brk is not None:
                brk.run(n)
        return hidden[:n]

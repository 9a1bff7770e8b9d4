"""The engine loop: ``add_request`` / ``step`` / ``abort`` over a scheduler, the KV-cache coordinator
and a model runner. ``LLM`` is the friendly facade; streaming users drive this directly.

Requests fail alone. Everything a request asks is checked against the model when it is submitted
(``RequestError``). What goes wrong later is attributed as narrowly as it can be:

- non-finite logits (NaN, inf) in a request's row finish that request with ``error`` set (``sampler.report``);
- an exception while sampling the batch is retried row by row; the rows that fail alone finish with ``error``;
- an exception in the batched forward (or anything else of a step) cannot be pinned on one request: the
  step's requests finish with ``error`` (the forward may have updated their Mamba states in place, so they
  cannot simply run again), the step before it is read back as usual, and every other request goes on.
  ``KeyboardInterrupt`` / ``SystemExit`` and errors that leave no working engine (a tensor-parallel rank
  gone, a CUDA fault that poisons the context: ``ENGINE_FATAL``) do the same, then propagate; their error
  outputs come with the next ``step``.

A finished request has released its blocks, its state slot and its row; ``check_idle`` checks that an engine
with nothing to do holds nothing.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.engine.config import DEFAULT_MAX_LOGPROBS
from hybridkv.engine.distributed import TensorParallelError
from hybridkv.engine.limits import EngineLimits, RequestError, decode_text
from hybridkv.engine.model_runner import ModelRunner, StepBatch, StepOutput, StepRunner, StepTables
from hybridkv.engine.request import (
    PENDING_TOKEN,
    CompletionOutput,
    OutputKind,
    Request,
    RequestOutput,
    RequestStatus,
    TokenLogprob,
)
from hybridkv.engine.sampler import (
    NONFINITE,
    LogitsProcessing,
    SamplingTensors,
    chosen_finite,
    logprobs_of,
    process_logits,
    report,
    row_max_finite,
    sample,
)
from hybridkv.engine.sampling_params import SamplingParams, effective_seed
from hybridkv.engine.scheduler import (
    DEFAULT_PREFILL_FLOOR,
    DEFAULT_PREFILL_SPREAD,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
)
from hybridkv.kv_groups.block_table import token_ranges
from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.metadata import host_to_device
from hybridkv.models.hybrid import HybridModel

logger = logging.getLogger("hybridkv.engine")


NONFINITE_ERROR = "the model produced non-finite logits (NaN or inf) for this request"
ENGINE_FATAL: tuple[type[BaseException], ...] = (TensorParallelError, torch.AcceleratorError)
"""Step failures after which the engine cannot run anything: they propagate (the step's requests failed)."""


STEP_SECONDS_BUCKETS = (*(round(0.00025 * i, 5) for i in range(1, 41)), 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1,
                        0.25, 0.5, 1.0)
"""Upper bounds of the step-interval histogram (``EngineStats.step_seconds``): 0.25 ms apart up to 10 ms, where
the inter-token latency targets of a serving engine lie."""


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    steps: int
    # The time from one step's start to the next's while the engine stays busy (the steps that only read back the
    # last tokens included): what a decoding request waits between tokens before the API side. Counts per
    # ``STEP_SECONDS_BUCKETS`` bound (value <= bound), the last past every bound; and their sum.
    step_seconds: tuple[int, ...]
    step_seconds_sum: float
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int


def _start_copy(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Logprob tensors on their way to the host: the copies are queued before the step's token copy, whose
    event ``_finish`` waits on (reading device tensors there would wait for the next step as well)."""
    return tuple(t.to("cpu", non_blocking=True) if t.is_cuda else t for t in values)


@dataclass(frozen=True, kw_only=True, eq=False)
class _PromptLogprobs:
    """One request's prompt logprobs of a step, on their way to the host with the step's tokens (positions
    ``first``.. predict ``targets``)."""

    request: Request
    first: int
    targets: list[int]
    values: tuple[torch.Tensor, ...]      # (chosen, top values, top ids), copying to the host


@dataclass(frozen=True, kw_only=True, eq=False)
class _Launched:
    """A step whose forward and sampling are queued on the device; its sampled tokens reach the host
    later (``tokens_on_host``). Each sampler holds a ``PENDING_TOKEN`` at ``positions`` until then."""

    batch: ScheduledBatch
    samplers: list[Request]                # requests that sampled, in logits-row order
    rows: np.ndarray                       # (S,) their coordinator rows at launch
    positions: np.ndarray                  # (S,) index of each one's new token in its token_ids
    tokens: torch.Tensor                   # (S,) int64 on the device: the next step's input ids
    host: torch.Tensor                     # (S,) int64 host copy of the reported tokens (NONFINITE where the
                                           # row's logits were not finite), filled asynchronously on CUDA
    ready: torch.cuda.Event | None         # recorded after the copy (None: already on the host)
    logprobs: tuple[torch.Tensor, ...] | None   # (chosen, top values, top ids), copying to the host
    prompt_logprobs: list[_PromptLogprobs]  # of this step's prompt chunks, recorded with its tokens
    failed: dict[Request, str] = field(default_factory=dict)   # requests whose sampling or logprobs failed

    def tokens_on_host(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.numpy()


class LLMEngine:
    """``async_scheduling``: schedule and prepare step N+1 while the device runs step N (the sampled
    tokens of step N feed step N+1 on the device and reach the host one step later); outputs then lag
    one step, and a request that stops on a token computes one more step that is thrown away. None = on
    for an in-process runner on CUDA, where the host's work per step would otherwise leave the GPU idle.
    ``max_logprobs``: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (-1: the vocabulary).

    Logits processing (logit bias, min_tokens, penalties) keeps per-row state on the device, written when a
    request takes a row: its bias and masked ids, and for penalties its token history in a
    (max_num_seqs, longest such request) int32 buffer, made on first use and grown by doubling; each step
    appends the sampled tokens on the device. A step without such requests pays nothing for it."""

    def __init__(self, model: HybridModel, plan: KVCachePlan, *, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_spread: int = DEFAULT_PREFILL_SPREAD, prefill_floor: int = DEFAULT_PREFILL_FLOOR,
                 enable_prefix_caching: bool = True,
                 backend: str = "auto", tokenizer: object | None = None, seed: int = 0,
                 runner: StepRunner | None = None, cuda_graphs: bool | None = None,
                 async_scheduling: bool | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        self.model = model
        self.plan = plan
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        if not isinstance(max_logprobs, int) or max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or >= 0, got {max_logprobs!r}")
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        has_mamba = bool(plan.mamba_groups)
        self.coordinator = KVCacheCoordinator(plan, enable_prefix_caching=enable_prefix_caching,
                                              max_num_reqs=max_num_seqs)
        scheduler_config = SchedulerConfig(           # (validated before the runner's minutes of start-up)
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=plan.max_model_len, align_prefill_chunks=has_mamba and enable_prefix_caching,
            prefill_spread=prefill_spread, prefill_floor=prefill_floor)
        self.runner = runner if runner is not None else ModelRunner(
            model, plan, backend=backend, cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens)
        # a spread step's prompt cap rounds up to the token counts the runner's graphs pad a step to
        mixed_graphs = getattr(self.runner, "mixed_graphs", None)
        self.scheduler = Scheduler(scheduler_config, self.coordinator,
                                   step_sizes=mixed_graphs.buckets if mixed_graphs is not None else ())
        # where the step's device tensors live: the runner's (a stand-in runner may hold no model), else the model's
        self.device = getattr(self.runner, "device", None) or next(model.parameters()).device
        self._seeds = np.random.default_rng(seed)
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._num_streamed_requests = 0            # unfinished requests with outputs before they finish
        self._num_prompt_logprob_requests = 0      # ... that want prompt logprobs
        self._num_processed_requests = 0           # ... that need logits processing (bias, min_tokens, penalties)
        self._num_penalty_requests = 0             # ... that use penalties (a token history on the device)
        self._num_cumulative_requests = 0          # ... whose outputs are cumulative
        self._num_stop_string_requests = 0         # ... with stop strings (checked on every token)
        self._stop_token_counts: collections.Counter[int] = collections.Counter()   # their stop token ids
        self._stop_token_array = np.array(sorted(self.eos_token_ids), np.int64)     # ... and EOS: may end a request
        self._steps = self._prompt_tokens = self._generated = 0
        self._step_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)
        self._step_seconds_sum = 0.0
        self._last_step_start: float | None = None     # None: the engine was idle before this step
        # Largest request the pool can ever hold next to the per-step reserve.
        self._capacity_blocks = plan.num_blocks - 1 - plan.reserved_step_blocks
        self._arange = np.arange(max_num_seqs, dtype=np.int64)     # a decode step's logits rows are 0..n-1
        # plan group -> its attention table in the coordinator (None: a Mamba group)
        self._table_of_group = [self.coordinator.table_index.get(g.group_id) for g in plan.groups]
        in_process = isinstance(self.runner, ModelRunner)
        if async_scheduling and not in_process:
            raise ValueError("async_scheduling needs the in-process model runner (not tensor parallelism yet)")
        self.async_scheduling = (in_process and self.runner.device.type == "cuda") if async_scheduling is None \
            else async_scheduling
        logger.info("asynchronous scheduling %s", "on" if self.async_scheduling else "off")
        self._inflight: _Launched | None = None
        self._pinned: list[torch.Tensor] = []        # two alternating host buffers for sampled tokens (CUDA)
        self._undelivered: list[RequestOutput] = []  # error outputs of a step interrupted by a BaseException
        self.limits = EngineLimits.of(self)           # what a request is checked against (API processes too)
        # Per coordinator row, written when a request takes the row (``_note_admissions``): its owner and what
        # logits processing it needs. Device buffers are made on first use and widened as needed.
        R = max_num_seqs
        self._row_owner = np.full(R, None, dtype=object)
        self._row_processed = np.zeros(R, bool)
        self._row_penalized = np.zeros(R, bool)
        self._row_penalties = np.zeros((R, 3), np.float32)      # presence, frequency, repetition
        self._row_num_bias = np.zeros(R, np.int64)
        self._row_num_masked = np.zeros(R, np.int64)
        self._row_min_tokens = np.zeros(R, np.int64)
        self._row_stop_strings = np.zeros(R, bool)
        self._history: torch.Tensor | None = None              # (R, cap) int32 token ids (penalties)
        self._bias_ids: torch.Tensor | None = None             # (R, K) int64
        self._bias_values: torch.Tensor | None = None          # (R, K) float32
        self._masked_ids: torch.Tensor | None = None           # (R, M) int64 (min_tokens)

    # -- requests ------------------------------------------------------------------------------------
    def validate_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` with the reason a request cannot be served."""
        self._check_request(token_ids, params)

    def _check_request(self, token_ids: object, params: object) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of ints and the params as the engine runs them (``max_tokens`` resolved), or
        ``RequestError`` with the first reason the request cannot be served (``EngineLimits``)."""
        return self.limits.check_request(token_ids, params)

    def add_request(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    *, prompt: str | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Queue one sequence; ``RequestError`` (nothing queued) when it cannot be served. ``output_kind``:
        which outputs ``step`` builds for it (``OutputKind``)."""
        if not isinstance(request_id, str):
            raise RequestError(f"request ids are strings, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids, params = self._check_request(token_ids, params)
        seed = effective_seed(params.seed) if params.seed is not None else int(self._seeds.integers(0, 2**62))
        req = Request(request_id=request_id, token_ids=ids, num_prompt_tokens=len(ids), params=params, seed=seed,
                      arrival=next(self._arrivals), prompt=prompt, output_kind=OutputKind(output_kind))
        if not self.has_unfinished:             # idle until now: no request waited through that gap
            self._last_step_start = None
        self._requests[request_id] = req
        self._count(req, +1)
        self.scheduler.add(req)

    def _count(self, req: Request, sign: int) -> None:
        params = req.params
        self._num_streamed_requests += sign * (req.output_kind is not OutputKind.FINAL)
        self._num_prompt_logprob_requests += sign * (params.prompt_logprobs is not None)
        self._num_processed_requests += sign * self._needs_processing(params)
        self._num_penalty_requests += sign * params.has_penalties
        self._num_cumulative_requests += sign * (req.output_kind is OutputKind.CUMULATIVE)
        self._num_stop_string_requests += sign * bool(params.stop)
        if params.stop_token_ids:
            counts = self._stop_token_counts
            counts.update({t: sign for t in set(params.stop_token_ids)})
            for t in [t for t, c in counts.items() if c <= 0]:
                del counts[t]
            self._stop_token_array = np.array(sorted(self.eos_token_ids.union(counts)), np.int64)

    def _min_tokens_ids(self, params: SamplingParams) -> list[int]:
        """What ``min_tokens`` keeps from being sampled: the stop token ids and EOS (unless ignored)."""
        if params.min_tokens == 0:
            return []
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return list(dict.fromkeys([*params.stop_token_ids, *eos]))

    def _needs_processing(self, params: SamplingParams) -> bool:
        return params.has_penalties or bool(params.logit_bias) or bool(self._min_tokens_ids(params))

    def abort(self, request_id: str) -> bool:
        """Finish a request wherever it is (finish_reason "abort") and free what it holds; False if unknown
        or already finished."""
        self._undelivered = [o for o in self._undelivered if o.request_id != request_id]
        req = self.scheduler.abort(request_id)
        if req is None:
            stale = self._requests.get(request_id)
            if stale is not None and stale.finished:        # finished by a step that was interrupted
                self._forget(stale)
            return False
        req.drop_pending()
        req.finished_time = time.monotonic()
        self._forget(req)
        if self._inflight is not None and not self.scheduler.has_unfinished:
            self._inflight = None       # every request of the step in flight is gone: nothing to read back
        return True

    def _forget(self, req: Request) -> None:
        if self._requests.pop(req.request_id, None) is not None:
            self._count(req, -1)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None or bool(self._undelivered)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def check_idle(self) -> None:
        """Raise ``AssertionError`` unless the engine holds nothing: no request (queued, running, in flight or
        with undelivered outputs), every block free or cached, every working state slot free, the
        coordinator's own invariants intact. Tests call it after every public call that ends a batch."""
        problems = []
        if self._requests:
            problems.append(f"{len(self._requests)} requests still known: {sorted(self._requests)[:5]}")
        if self.scheduler.waiting or self.scheduler.running:
            problems.append(f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} running")
        if self.scheduler.queued_tokens:
            problems.append(f"the scheduler counts {self.scheduler.queued_tokens} waiting tokens")
        if self._inflight is not None:
            problems.append("a step is still in flight")
        if self._undelivered:
            problems.append(f"{len(self._undelivered)} undelivered outputs")
        counts = (self._num_streamed_requests, self._num_prompt_logprob_requests, self._num_processed_requests,
                  self._num_penalty_requests, self._num_cumulative_requests, self._num_stop_string_requests,
                  sum(self._stop_token_counts.values()))
        if any(counts):
            problems.append(f"request counters not zero: {counts}")
        coord = self.coordinator
        coord.check_invariants()
        if coord.num_requests:
            problems.append(f"the KV cache holds {coord.num_requests} requests")
        if self.plan.attention_groups and coord.num_free_blocks != self.plan.num_blocks - 1:
            problems.append(f"{self.plan.num_blocks - 1 - coord.num_free_blocks} blocks neither free nor cached")
        if self.plan.mamba_groups and coord.slots is not None \
                and coord.slots.num_free_slots != coord.slots.num_working_slots:
            problems.append(f"{coord.slots.num_working_slots - coord.slots.num_free_slots} working slots held")
        assert not problems, "engine not idle: " + "; ".join(problems)

    # -- one step --------------------------------------------------------------------------------------
    def step(self, *, only_finished: bool = False) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns an output for every request that finished, and for every
        unfinished one that advanced as its ``output_kind`` asks; with ``only_finished`` for those that
        finished only (building an output copies all of a request's tokens, which a non-streaming caller
        would throw away every step).

        With asynchronous scheduling the outputs are those of the previous step: this step is scheduled,
        built and queued on the device first, then the previous step's tokens are read (the device is
        busy meanwhile) and its requests advance. A failure fails the requests it touched (module
        docstring); the others go on."""
        outputs, self._undelivered = self._undelivered, []
        only_finished = only_finished or not self._num_streamed_requests
        batch = self.scheduler.schedule(spread=self._num_streamed_requests > 0)
        prev, self._inflight = self._inflight, None
        if batch.num_reqs == 0:
            if prev is not None:            # what is left waits for its last tokens: drain
                self._time_step()
                return outputs + self._finish_or_fail(prev, only_finished=only_finished)[0]
            if self.scheduler.running:
                raise RuntimeError("the scheduler made no progress with requests running")
            if self.scheduler.waiting:
                # (submission checks make this unreachable; if it happens, the request fails, not the engine)
                head = self.scheduler.waiting[0]
                outputs += self._fail_requests([head], "the request does not fit the KV cache: it cannot be "
                                                       "scheduled")
            return outputs
        self._steps += 1
        self._time_step()
        try:
            src, dst = self.coordinator.take_state_copies()
            self.runner.copy_states(list(zip(src.tolist(), dst.tolist(), strict=True)))
            step = self._step_batch(batch, prev)
            out = self.runner.execute(step)
            assert out is not None          # (None only on tensor-parallel ranks > 0, which run no engine)
            launched = self._launch(batch, step, out)
        except BaseException as exc:
            # The step's own requests fail (their Mamba states may be half-updated); the step before it is
            # read back as usual (a broken device fails that too).
            outputs += self._finish_or_fail(prev, only_finished=only_finished)[0] if prev is not None else []
            outputs += self._fail_requests(batch.requests, _step_error(exc, batch.num_reqs), exc)
            return self._deliver_or_raise(outputs, exc)
        try:
            stopped = False
            if prev is not None:
                done, stopped = self._finish(prev, only_finished=only_finished)
                outputs += done
            if self.plan.num_host_checkpoint_slots:
                self.coordinator.set_host_move_budget(self.runner.host_moves_available())
            self._commit(batch, skip_finished=stopped)
            if self.async_scheduling:
                # (every request it sampled for may have stopped meanwhile: then nothing waits for it)
                self._inflight = launched if self.scheduler.has_unfinished else None
            else:
                outputs += self._finish(launched, only_finished=only_finished)[0]
        except BaseException as exc:
            self._inflight = None
            involved = [*(prev.batch.requests if prev is not None else ()), *batch.requests]
            outputs += self._fail_requests(involved, _step_error(exc, len(involved)), exc)
            return self._deliver_or_raise(outputs, exc)
        return outputs

    def _time_step(self) -> None:
        """Count the time since the last step's start (``EngineStats.step_seconds``) unless the engine was idle
        (``add_request`` on an idle engine forgets that start)."""
        now = time.perf_counter()
        if self._last_step_start is not None:
            seconds = now - self._last_step_start
            self._step_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
            self._step_seconds_sum += seconds
        self._last_step_start = now

    def _deliver_or_raise(self, outputs: list[RequestOutput], exc: BaseException) -> list[RequestOutput]:
        """An ``Exception`` is contained: the outputs (failed requests included) are returned. Anything else
        (``KeyboardInterrupt``, ``SystemExit``, ``ENGINE_FATAL``) propagates; the outputs come with the next
        ``step``."""
        if isinstance(exc, Exception) and not isinstance(exc, ENGINE_FATAL):
            return outputs
        self._undelivered = outputs
        raise exc

    def _finish_or_fail(self, launched: _Launched, *, only_finished: bool) -> tuple[list[RequestOutput], bool]:
        """``_finish``; when reading the step back fails (a broken device), its requests fail instead."""
        try:
            return self._finish(launched, only_finished=only_finished)
        except Exception as exc:
            reqs = launched.batch.requests
            return self._fail_requests(reqs, _step_error(exc, len(reqs)), exc), True

    def _fail_requests(self, reqs: Sequence[Request], message: str,
                       exc: BaseException | None = None) -> list[RequestOutput]:
        """Finish every unfinished request of ``reqs`` with ``error`` = ``message``; their outputs."""
        failed = [r for r in dict.fromkeys(reqs) if not r.finished]
        if failed and isinstance(exc, Exception):
            logger.error("%s (requests %s)", message, [r.request_id for r in failed[:8]], exc_info=exc)
        now = time.monotonic()
        outputs = []
        for r in failed:
            r.error, r.finish_reason = message, "error"
            self._release(r, now)
            outputs.append(self.make_output(r))
        return outputs

    def _release(self, r: Request, now: float) -> None:
        """A request that has finished (``finish_reason`` set) gives back its row, blocks and state slot."""
        r.drop_pending()
        if r.status is RequestStatus.WAITING:         # never admitted: out of the queue
            reason = r.finish_reason
            self.scheduler.abort(r.request_id)
            r.finish_reason = reason
        elif r.status is not RequestStatus.FINISHED:
            self.scheduler.finish(r)
        r.finished_time = now
        self._forget(r)

    def _step_batch(self, batch: ScheduledBatch, prev: _Launched | None = None) -> StepBatch:
        """The runner's view of ``batch``; a token still on its way from ``prev`` (the step in flight)
        is taken from ``prev.tokens`` on the device."""
        self._note_admissions(batch)
        reqs, sched = batch.requests, self.scheduler
        new, computed, rows = batch.num_new_tokens, batch.num_computed, batch.rows
        n = len(reqs)
        seq_lens = computed + new
        decode = batch.decode or (n > 0 and int(new.sum()) == n
                                  and bool((seq_lens == sched.row_num_tokens[rows]).all()))
        if decode:                                  # every request continues from its last token
            ids = sched.row_last_token[rows]
            token_rows, positions = rows, computed
        else:
            ids = self._mixed_input_ids(reqs, rows, computed, new, seq_lens)
            owner, positions = token_ranges(computed, new)
            token_rows = rows[owner]
        tables = self._step_tables(rows, seq_lens, token_rows, positions)
        sources = None
        if prev is not None:                # a row's last token may be one ``prev`` sampled
            pending = sched.row_pending[token_rows]
            if not decode:                  # only the last token of a row can be pending
                pending = np.where(positions == sched.row_num_tokens[token_rows] - 1, pending, -1)
            if np.count_nonzero(pending >= 0):
                sources = pending
        greedy = bool((sched.row_sampling[rows, 0] == 0).all())                # temperature 0 everywhere
        needs_logits = (not greedy or bool(self._num_prompt_logprob_requests)     # sampling or logprobs
                        or bool((sched.row_logprobs[rows] >= 0).any())
                        or (bool(self._num_processed_requests) and bool(self._row_processed[rows].any())))
        extra = dict(greedy=greedy, needs_logits=needs_logits)
        if sources is not None:
            extra.update(input_sources=sources, prev_tokens=prev.tokens)
        # Logits: the last token of requests that reach their end this step; every token of prompt
        # chunks whose request asked for prompt logprobs. (Decodes always reach their end.)
        if decode and not self._num_prompt_logprob_requests:
            if n > self._arange.shape[0]:
                self._arange = np.arange(n, dtype=np.int64)
            return StepBatch(input_ids=ids, query_lens=new, seq_lens=seq_lens, block_tables=tables,
                             logits_indices=self._arange[:n], **extra)
        ends = np.cumsum(new)
        samples = seq_lens == sched.row_num_tokens[rows]
        wants = (np.fromiter((r.params.prompt_logprobs is not None for r in reqs), bool, n)
                 if self._num_prompt_logprob_requests else np.zeros(n, bool))
        lengths = np.where(wants, new, samples)
        starts = np.where(wants, ends - new, ends - 1)
        index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        return StepBatch(input_ids=ids, query_lens=new, seq_lens=seq_lens, block_tables=tables,
                         logits_indices=index.astype(np.int64), **extra)

    def _mixed_input_ids(self, reqs: Sequence[Request], rows: np.ndarray, computed: np.ndarray, new: np.ndarray,
                         seq_lens: np.ndarray) -> np.ndarray:
        """(T,) int64 input ids of a step that is not all decodes: a decoding request's one token from the
        scheduler's row array, the others' from their token lists (a pending token's id is a placeholder
        either way: ``input_sources`` replaces it)."""
        ends = np.cumsum(new)
        ids = np.empty(int(ends[-1]) if ends.size else 0, np.int64)
        last = (new == 1) & (seq_lens == self.scheduler.row_num_tokens[rows])
        ids[ends[last] - 1] = self.scheduler.row_last_token[rows[last]]
        for i in np.flatnonzero(~last).tolist():
            c, e = int(computed[i]), int(ends[i])
            ids[e - int(new[i]):e] = reqs[i].token_ids[c:c + int(new[i])]
        return ids

    def _note_admissions(self, batch: ScheduledBatch) -> None:
        """Requests that took a row since it was last looked at (admitted, or re-admitted after preemption):
        first-scheduled time and prefix-cache hit, and their logits-processing state. A pure decode batch
        admits nothing and costs nothing here."""
        if batch.decode or not batch.num_reqs:
            return
        reqs, rows = batch.requests, batch.rows
        current = np.empty(len(reqs), dtype=object)
        current[:] = reqs
        new = np.flatnonzero(self._row_owner[rows] != current)
        if not new.size:
            return
        now = time.monotonic()
        for i in new.tolist():
            r, row = reqs[i], int(rows[i])
            self._row_owner[row] = r
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
                r.num_cached_tokens = int(batch.num_computed[i])
            self._load_row(row, r)

    def _load_row(self, row: int, r: Request) -> None:
        """Write request ``r``'s logits-processing state into row ``row`` (host arrays and device buffers)."""
        p = r.params
        masked = self._min_tokens_ids(p)
        self._row_processed[row] = processed = p.has_penalties or bool(p.logit_bias) or bool(masked)
        self._row_penalized[row] = p.has_penalties
        self._row_stop_strings[row] = bool(p.stop)          # (checked with or without a tokenizer: a superset)
        if not processed:
            return
        self._row_penalties[row] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self._row_num_bias[row] = len(p.logit_bias)
        self._row_num_masked[row] = len(masked)
        self._row_min_tokens[row] = p.min_tokens
        if p.has_penalties:
            assert not r.num_pending, "a request takes a row with all its tokens on the host"
            self._grow_history(r.num_tokens + 1)
            assert self._history is not None
            self._history[row, :r.num_tokens] = host_to_device(np.asarray(r.token_ids, np.int32), self.device)
        if p.logit_bias:
            ids, values = list(p.logit_bias), list(p.logit_bias.values())
            self._bias_ids, self._bias_values = self._padded_row(self._bias_ids, row, ids, torch.int64), \
                self._padded_row(self._bias_values, row, values, torch.float32, pad=0.0)
        if masked:
            self._masked_ids = self._padded_row(self._masked_ids, row, masked, torch.int64)

    def _padded_row(self, buffer: torch.Tensor | None, row: int, values: list, dtype: torch.dtype,
                    pad: float | None = None) -> torch.Tensor:
        """``buffer`` (R, width), made or widened by doubling as needed, with row ``row`` = ``values`` padded by
        ``pad`` (None: the row's first value, so padded ids repeat a real one). Widening pads every row the
        same way."""
        k = len(values)
        if buffer is None or buffer.shape[1] < k:
            width = max(k, 2 * buffer.shape[1] if buffer is not None else 4)
            grown = torch.zeros(len(self._row_owner), width, dtype=dtype, device=self.device)
            if buffer is not None:
                grown[:, :buffer.shape[1]] = buffer
                grown[:, buffer.shape[1]:] = buffer[:, :1] if pad is None else pad
            buffer = grown
        filler = values[0] if pad is None else pad
        padded = np.full(buffer.shape[1], filler, np.float32 if dtype == torch.float32 else np.int64)
        padded[:k] = values
        buffer[row] = host_to_device(padded, self.device)
        return buffer

    def _grow_history(self, length: int) -> None:
        """The penalty token history holds ``length`` tokens per row (grown by doubling, up to max_model_len + 1)."""
        have = 0 if self._history is None else self._history.shape[1]
        if length <= have:
            return
        cap = min(max(length, 2 * have, 64), self.plan.max_model_len + 1)
        grown = torch.zeros(len(self._row_owner), max(cap, length), dtype=torch.int32, device=self.device)
        if self._history is not None:
            grown[:, :have] = self._history
        self._history = grown

    def _step_tables(self, rows: np.ndarray, seq_lens: np.ndarray, token_rows: np.ndarray,
                     positions: np.ndarray) -> StepTables:
        """The step's block tables and KV slots as the coordinator keeps them (batch ``rows`` (B,) reading
        ``seq_lens`` keys; ``token_rows``, ``positions``: (T,) row and position of every query token)."""
        coord = self.coordinator
        tables: list[np.ndarray] = []
        starts: list[np.ndarray | None] = []
        slots: list[np.ndarray | None] = []
        width = 1
        if self.plan.attention_groups:
            attn_tables, attn_starts, width = coord.step_tables(rows, seq_lens)
            attn_slots = coord.block_tables.slot_mapping(token_rows, positions)      # (G, T)
        for i in self._table_of_group:
            if i is None:                                                     # Mamba: the working slot
                tables.append(coord.state_slots(rows)[:, None])
                starts.append(None)
                slots.append(None)
            else:
                tables.append(attn_tables[i])
                starts.append(attn_starts[i])
                slots.append(attn_slots[i])
        return StepTables(tables=tables, starts=starts, slots=slots, width=width)

    def _launch(self, batch: ScheduledBatch, step: StepBatch, out: StepOutput) -> _Launched:
        """Sample on the device for the requests that reach their end this step and start copying the
        tokens to the host; each sampler gets a ``PENDING_TOKEN`` until ``_finish`` reads its token."""
        reqs, sched = batch.requests, self.scheduler
        new, computed = batch.num_new_tokens, batch.num_computed
        samples = computed + new == sched.row_num_tokens[batch.rows]
        sample_idx = np.flatnonzero(samples)
        samplers = reqs if sample_idx.size == len(reqs) else [reqs[i] for i in sample_idx.tolist()]
        logits, greedy, greedy_report = out.logits, out.greedy, out.report
        prompt_logprobs = []
        failed: dict[Request, str] = {}
        if self._num_prompt_logprob_requests:        # logits rows of prompt chunks come first per request
            wants = np.array([r.params.prompt_logprobs is not None for r in reqs], bool)
            lengths = np.where(wants, new, samples)
            offsets = np.cumsum(lengths) - lengths
            sample_rows = (offsets + lengths - 1)[sample_idx]
            for i in np.flatnonzero(wants).tolist():
                try:
                    chunk = self._prompt_logprobs(reqs[i], int(computed[i]), int(new[i]),
                                                  logits[int(offsets[i]):int(offsets[i] + new[i])])
                except Exception as exc:
                    failed[reqs[i]] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
                    continue
                if chunk is not None:
                    prompt_logprobs.append(chunk)
        else:
            sample_rows = None          # the logits rows are the samplers, in order
        self._prompt_tokens += int(np.maximum(np.minimum(computed + new, sched.row_num_prompt[batch.rows])
                                              - computed, 0).sum())
        rows = batch.rows[sample_idx]
        if sample_rows is None:
            picked = None if logits is None else logits[:sample_idx.size]
            greedy = None if greedy is None else greedy[:sample_idx.size]
            greedy_report = None if greedy_report is None else greedy_report[:sample_idx.size]
        else:
            assert logits is not None            # prompt logprobs: the step needed its logits
            index = torch.as_tensor(sample_rows, device=logits.device)
            picked = logits[index]
            greedy = None if greedy is None else greedy[index]
            greedy_report = None if greedy_report is None else greedy_report[index]
        try:
            tokens, reported, logprobs = self._sample(rows, picked, greedy, greedy_report)
        except Exception as exc:     # a batch-wide failure: find the rows that fail alone
            logger.warning("sampling the batch failed (%s: %s); sampling its rows one by one", type(exc).__name__, exc)
            tokens, reported, logprobs, row_errors = self._sample_alone(rows, picked, greedy, greedy_report)
            failed.update((samplers[i], message) for i, message in row_errors.items())
        positions = sched.row_num_tokens[rows].copy()
        if self._num_penalty_requests:
            self._append_history(rows, positions, tokens)
        sched.add_sampled(rows)
        for r in samplers:
            r.token_ids.append(PENDING_TOKEN)
            r.num_pending += 1
        host, ready = self._to_host(reported)
        return _Launched(batch=batch, samplers=samplers, rows=rows, positions=positions, tokens=tokens,
                         host=host, ready=ready, logprobs=logprobs, prompt_logprobs=prompt_logprobs, failed=failed)

    def _append_history(self, rows: np.ndarray, positions: np.ndarray, tokens: torch.Tensor) -> None:
        """Penalized rows' new tokens into their device history, where the next step's penalties read them."""
        sel = np.flatnonzero(self._row_penalized[rows])
        if not sel.size:
            return
        pos = positions[sel]
        self._grow_history(int(pos.max()) + 1)
        assert self._history is not None
        dev = tokens.device
        self._history[host_to_device(rows[sel], dev), host_to_device(pos, dev)] = \
            tokens[host_to_device(sel, dev)].to(torch.int32)

    def _to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the device-to-host copy of a step's tokens: into one of two pinned buffers (the other may
        still hold the step in flight), with an event to wait on; on the CPU the tokens are the copy."""
        if tokens.device.type != "cuda":
            return tokens, None
        n = tokens.shape[0]
        if not self._pinned or self._pinned[0].shape[0] < n:
            size = max(n, self.scheduler.config.max_num_seqs)
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()
        host = self._pinned[0][:n]
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _commit(self, batch: ScheduledBatch, *, skip_finished: bool) -> None:
        """Register what the step computed (its input tokens are all known by now). ``skip_finished``:
        some requests finished since it was scheduled (a stop token of the step before) and have released
        their cache; they are left out."""
        rows, ends = batch.rows, batch.num_computed + batch.num_new_tokens
        if skip_finished:
            alive = np.fromiter((not r.finished for r in batch.requests), bool, len(batch.requests))
            rows, ends = rows[alive], ends[alive]
        self.coordinator.commit_batch(rows, ends)

    def _finish(self, launched: _Launched, *, only_finished: bool) -> tuple[list[RequestOutput], bool]:
        """Put a launched step's tokens in place, check stops, finish requests. Returns the outputs and
        whether any request finished.

        One pass over the samplers does the per-request work (the token into its list, the stop check, a
        streamed request's output); everything else is vectorised or left to the rare requests it concerns."""
        tokens = launched.tokens_on_host()
        toks = tokens.tolist()
        lp = None if launched.logprobs is None else [t.tolist() for t in launched.logprobs]
        failed = launched.failed
        for chunk in launched.prompt_logprobs:
            if not chunk.request.finished:            # (aborted meanwhile)
                self._record_prompt_logprobs(chunk)
        now = time.monotonic()
        # The stop check runs where a token could end its request: a length limit reached, a token that is
        # some request's stop or EOS, a request with stop strings (all rare in a step).
        check = launched.positions + 1 >= self.scheduler.row_final[launched.rows]
        stop_ids = self._stop_token_array
        if stop_ids.size > 8:
            check |= np.isin(tokens, stop_ids)
        else:
            for t in stop_ids.tolist():     # (a few ids: np.isin's own setup costs more)
                check |= tokens == t
        if self._num_stop_string_requests:
            check |= self._row_stop_strings[launched.rows]
        check = check.tolist()
        stopped: list[Request] = []
        gone = []                           # samplers whose row is no longer theirs (or who failed)
        dropped = 0                         # ... of which the tokens were not kept
        outputs: list[RequestOutput] = []
        stream = not only_finished
        finished, delta = RequestStatus.FINISHED, OutputKind.DELTA
        rows = launched.rows.tolist()
        for i, (r, p, tok) in enumerate(zip(launched.samplers, launched.positions.tolist(), toks, strict=True)):
            if r.status is finished:        # stopped a step earlier, or aborted: the token is dropped
                gone.append(i)
                dropped += 1
                continue
            if tok == NONFINITE or (failed and r in failed):
                r.error, r.finish_reason = failed.get(r, NONFINITE_ERROR), "error"
                stopped.append(r)
                gone.append(i)
                dropped += 1
                continue
            r.token_ids[p] = tok
            r.num_pending -= 1
            if r.first_token_time is None:
                r.first_token_time = now
            r.last_token_time = now
            if lp is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                r.logprobs.append(TokenLogprob(token_id=tok, logprob=lp[0][i],
                                               top=tuple(zip(lp[2][i][:k], lp[1][i][:k], strict=True))))
            if r.kv_row < 0:                # preempted while its token was on its way
                gone.append(i)
            if (check[i] or r.kv_row != rows[i]) and self._stops(r, tok, p + 1):    # (its row changed: checked)
                stopped.append(r)
            elif stream and r.output_kind is delta:
                outputs.append(self._delta_output(r))
        self._generated += len(toks) - dropped
        for r, message in failed.items():   # a prompt chunk whose logprobs failed (no token this step)
            if not r.finished and r.finish_reason is None:
                r.error, r.finish_reason = message, "error"
                stopped.append(r)
        sched = self.scheduler
        if gone:
            keep = np.ones(len(toks), bool)
            keep[gone] = False
            sched.set_last_tokens(launched.rows[keep], tokens[keep])
        else:
            sched.set_last_tokens(launched.rows, tokens)
        for r in stopped:
            self._release(r, now)
        finals = [self.make_output(r) for r in stopped]
        if only_finished:
            return finals, bool(stopped)
        if self._num_cumulative_requests:
            done = set(stopped)
            outputs += [self.make_output(r) for r in launched.batch.requests
                        if r.output_kind is OutputKind.CUMULATIVE and not r.finished and r not in done]
        return outputs + finals, bool(stopped)

    def _sample(self, rows: np.ndarray, logits: torch.Tensor | None, greedy: torch.Tensor | None,
                greedy_report: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One token per sampling request (coordinator ``rows``, (B,)) on the device ((B,) int64), the tokens
        as the host reads them (``NONFINITE`` where a row's logits were not finite) and the logprobs asked
        for; ``greedy``: the logits' argmax when the step computed it, ``greedy_report`` its report (``logits``
        None: a greedy step that needed nothing else). The per-row parameters come from the scheduler's and
        the engine's row arrays: no loop over requests."""
        if logits is None:
            assert greedy is not None, "a step without logits returns its greedy tokens"
            return greedy, (greedy if greedy_report is None else greedy_report), None
        device, sched = logits.device, self.scheduler
        knobs = sched.row_sampling[rows]                                   # (B, 3): temperature, top_p, min_p
        top_k = sched.row_top_k[rows]
        processed = bool(self._num_processed_requests) and bool(self._row_processed[rows].any())
        x = self._process(rows, logits) if processed else logits

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        if (knobs[:, 0] == 0).all():     # greedy batch: the argmax, no parameter tensors to ship
            if greedy is not None and not processed:
                tokens = greedy
                reported = greedy_report if greedy_report is not None else report(tokens, chosen_finite(logits, tokens))
            else:
                tokens = x.argmax(-1)
                reported = report(tokens, row_max_finite(logits) if processed else chosen_finite(logits, tokens))
        else:
            st = SamplingTensors(
                temperature=dev(knobs[:, 0]), top_k=dev(top_k), top_p=dev(knobs[:, 1]), min_p=dev(knobs[:, 2]),
                seeds=dev(sched.row_seed[rows]),
                counters=dev(sched.row_num_tokens[rows] - sched.row_num_prompt[rows]),   # outputs so far
                needs_filtering=bool((top_k > 0).any() or (knobs[:, 1] < 1).any() or (knobs[:, 2] > 0).any()),
            )
            tokens = sample(x, st)
            reported = report(tokens, row_max_finite(logits))
        asked = sched.row_logprobs[rows]
        if not (asked >= 0).any():
            return tokens, reported, None
        return tokens, reported, _start_copy(logprobs_of(logits, tokens, int(asked.max())))

    def _process(self, rows: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) raw logits of sampler ``rows`` (B,) -> logits with each row's bias, min-tokens mask and
        penalties applied (a copy; rows without processing unchanged)."""
        sched = self.scheduler
        idx = np.flatnonzero(self._row_processed[rows])
        prow = rows[idx]
        dev = logits.device

        def d(a: np.ndarray) -> torch.Tensor:
            return host_to_device(np.ascontiguousarray(a), dev)

        prow_dev = d(prow)
        num_bias, num_masked = self._row_num_bias[prow], self._row_num_masked[prow]
        outputs = sched.row_num_tokens[prow] - sched.row_num_prompt[prow]
        active = (outputs < self._row_min_tokens[prow]) & (num_masked > 0)
        penalized = self._row_penalized[prow]
        parts: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("bias_ids", "bias_values", "masked_ids", "mask_active", "history", "num_prompt", "num_tokens",
             "presence", "frequency", "repetition"))
        if num_bias.any():
            assert self._bias_ids is not None and self._bias_values is not None
            k = int(num_bias.max())
            parts.update(bias_ids=self._bias_ids[prow_dev, :k],
                         bias_values=torch.where(torch.arange(k, device=dev)[None, :] < d(num_bias)[:, None],
                                                 self._bias_values[prow_dev, :k], 0.0))
        if active.any():
            assert self._masked_ids is not None
            parts.update(masked_ids=self._masked_ids[prow_dev, :int(num_masked.max())], mask_active=d(active))
        if penalized.any():
            assert self._history is not None
            lengths = np.where(penalized, sched.row_num_tokens[prow], 0)
            pen = self._row_penalties[prow]
            parts.update(history=self._history[prow_dev, :int(lengths.max())].long(),
                         num_prompt=d(sched.row_num_prompt[prow]), num_tokens=d(lengths), presence=d(pen[:, 0]),
                         frequency=d(pen[:, 1]), repetition=d(pen[:, 2]))
        proc = LogitsProcessing(**parts)
        if idx.size == rows.size:
            return process_logits(logits, proc)
        full = logits.clone()
        index = d(idx)
        full.index_copy_(0, index, process_logits(logits.index_select(0, index), proc))
        return full

    def _sample_alone(self, rows: np.ndarray, logits: torch.Tensor | None, greedy: torch.Tensor | None,
                      greedy_report: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None, dict[int, str]]:
        """``_sample`` one row at a time (after the batch failed): the rows that fail alone get token 0 on the
        device and an error; the others their token. Host work per row: an error path only."""
        tokens, reported, logprobs, errors = [], [], [], {}
        for i in range(rows.size):
            one = slice(i, i + 1)
            try:
                t, rep, lp = self._sample(rows[one], None if logits is None else logits[one],
                                          None if greedy is None else greedy[one],
                                          None if greedy_report is None else greedy_report[one])
                lp = None if lp is None else tuple(v.cpu() for v in lp)
            except Exception as exc:
                errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                t = torch.zeros(1, dtype=torch.int64, device=logits.device if logits is not None else self.device)
                rep, lp = torch.full_like(t, NONFINITE), None
            tokens.append(t)
            reported.append(rep)
            logprobs.append(lp)
        width = max((lp[1].shape[1] for lp in logprobs if lp is not None), default=None)
        merged = None
        if width is not None:
            chosen = torch.zeros(rows.size, dtype=torch.float32)
            values = torch.full((rows.size, width), float("-inf"))
            ids = torch.zeros((rows.size, width), dtype=torch.int64)
            for i, lp in enumerate(logprobs):
                if lp is not None:
                    chosen[i] = lp[0][0]
                    values[i, :lp[1].shape[1]] = lp[1][0]
                    ids[i, :lp[2].shape[1]] = lp[2][0]
            merged = (chosen, values, ids)
        return torch.cat(tokens), torch.cat(reported), merged, errors

    @staticmethod
    def _prompt_logprobs(r: Request, start: int, n: int, logits: torch.Tensor) -> _PromptLogprobs | None:
        """A prompt chunk's logprobs, copying to the host: logits at prompt position p predict token p + 1."""
        end = min(start + n, r.num_prompt_tokens - 1)       # positions whose next token is a prompt token
        targets = r.token_ids[start + 1:end + 1] if end > start else []
        if start and not targets:
            return None
        values = logprobs_of(logits[:len(targets)], torch.as_tensor(targets, dtype=torch.int64,
                                                                     device=logits.device),
                             r.params.prompt_logprobs or 0)
        return _PromptLogprobs(request=r, first=start, targets=targets, values=_start_copy(values))

    @staticmethod
    def _record_prompt_logprobs(chunk: _PromptLogprobs) -> None:
        r = chunk.request
        if chunk.first == 0:
            r.prompt_logprobs = [None]              # nothing predicts the first prompt token
        chosen, values, ids = (t.tolist() for t in chunk.values)
        for i, tok in enumerate(chunk.targets):
            r.prompt_logprobs.append(TokenLogprob(token_id=tok, logprob=chosen[i],
                                                  top=tuple(zip(ids[i], values[i], strict=True))))

    def _stops(self, r: Request, tok: int, known: int) -> bool:
        """Whether ``tok``, the request's ``known``-th token, ends it (sets ``finish_reason`` and
        ``stop_reason``). Before ``min_tokens`` outputs only the length limits end it."""
        p = r.params
        num_out = known - r.num_prompt_tokens
        if num_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                r.finish_reason, r.stop_reason = "stop", tok
            elif tok in self.eos_token_ids and not p.ignore_eos:
                r.finish_reason = "stop"
            elif p.stop and self.tokenizer is not None:
                found = _first_stop(self.decode(r.token_ids[r.num_prompt_tokens:known], p), p.stop)
                if found is not None:
                    r.finish_reason, r.stop_reason = "stop", found[1]
        if r.finish_reason is None and (num_out >= p.max_tokens or known >= self.plan.max_model_len):
            r.finish_reason = "length"
        return r.finish_reason is not None

    def decode(self, ids: Sequence[int], params: SamplingParams) -> str:
        """Text of output token ids as a request with ``params`` gets it (needs a tokenizer)."""
        assert self.tokenizer is not None
        return decode_text(self.tokenizer, ids, params, takes_skip=self.limits.decode_skips)

    def make_output(self, r: Request) -> RequestOutput:
        p = r.params
        text = None
        if self.tokenizer is not None:
            text = self.decode(r.output_token_ids, p)
            found = _first_stop(text, p.stop) if p.stop else None
            if found is not None:
                cut, s = found
                text = text[:cut + len(s)] if p.include_stop_str_in_output else text[:cut]
        completion = CompletionOutput(index=0, token_ids=tuple(r.output_token_ids), text=text,
                                      finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                                      logprobs=tuple(r.logprobs) if p.logprobs is not None else None)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=(completion,), finished=r.finished, error=r.error, metrics=r.metrics,
                             num_cached_tokens=r.num_cached_tokens,
                             prompt_logprobs=(tuple(r.prompt_logprobs) if p.prompt_logprobs is not None
                                              else None))

    def _delta_output(self, r: Request) -> RequestOutput:
        """A DELTA request's output tokens (and logprobs) since its last output; no text, no metrics (the
        final output has them: built for every streamed request every step, they cost engine-thread time)."""
        first, start = r.num_prompt_tokens, r.num_delivered
        end = len(r.token_ids) - r.num_pending - first          # (``num_output_tokens``, inlined: a hot path)
        r.num_delivered = end
        completion = CompletionOutput(index=0, token_ids=tuple(r.token_ids[first + start:first + end]), text=None,
                                      finish_reason=None,
                                      logprobs=tuple(r.logprobs[start:end]) if r.params.logprobs is not None
                                      else None)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=(completion,), finished=False, num_cached_tokens=r.num_cached_tokens)

    def reset_counters(self) -> None:
        """Zero the counters ``stats`` reports (after the start-up warm-up)."""
        self._steps = self._prompt_tokens = self._generated = 0
        self._step_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)
        self._step_seconds_sum = 0.0
        self.scheduler.num_preemptions = 0
        self.coordinator.reset_stats()

    def stats(self) -> EngineStats:
        s = self.coordinator.stats
        return EngineStats(steps=self._steps, step_seconds=tuple(self._step_counts),
                           step_seconds_sum=self._step_seconds_sum, prompt_tokens=self._prompt_tokens,
                           generated_tokens=self._generated, preemptions=self.scheduler.num_preemptions,
                           prefix_hit_tokens=s.hit_tokens, prefix_query_tokens=s.query_tokens)


def _step_error(exc: BaseException, num_requests: int) -> str:
    if not isinstance(exc, Exception):
        return f"interrupted ({type(exc).__name__}) while its step ran"
    if isinstance(exc, ENGINE_FATAL):
        return f"the engine failed ({type(exc).__name__}: {exc})"
    return (f"the model step failed ({type(exc).__name__}: {exc}); it held {num_requests} requests, which all "
            "failed with it")


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in ``text`` (the longest at a tie), or None."""
    best = None
    for s in stops:
        at = text.find(s)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(s) > len(best[1]))):
            best = (at, s)
    return best



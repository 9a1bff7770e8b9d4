"""The engine loop: ``add_request`` / ``step`` / ``abort`` over a scheduler, the KV-cache coordinator
and a model runner. ``LLM`` is the friendly facade; streaming users drive this directly."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.engine.model_runner import ModelRunner, StepBatch, StepOutput, StepRunner, StepTables
from hybridkv.engine.request import (
    PENDING_TOKEN,
    CompletionOutput,
    Request,
    RequestOutput,
    TokenLogprob,
)
from hybridkv.engine.sampler import SamplingTensors, logprobs_of, sample
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridkv.kv_groups.block_table import token_ranges
from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.models.hybrid import HybridModel

logger = logging.getLogger("hybridkv.engine")


class RequestError(ValueError):
    """A request that cannot be served (empty, too long, bad token ids); other requests are unaffected."""


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    steps: int
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
    host: torch.Tensor                     # (S,) int64 host copy, filled asynchronously on CUDA
    ready: torch.cuda.Event | None         # recorded after the copy (None: already on the host)
    logprobs: tuple[torch.Tensor, ...] | None   # (chosen, top values, top ids), copying to the host
    prompt_logprobs: list[_PromptLogprobs]  # of this step's prompt chunks, recorded with its tokens

    def tokens_on_host(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.numpy()


class LLMEngine:
    """``async_scheduling``: schedule and prepare step N+1 while the device runs step N (the sampled
    tokens of step N feed step N+1 on the device and reach the host one step later); outputs then lag
    one step, and a request that stops on a token computes one more step that is thrown away. None = on
    for an in-process runner on CUDA, where the host's work per step would otherwise leave the GPU idle."""

    def __init__(self, model: HybridModel, plan: KVCachePlan, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, backend: str = "auto", tokenizer: object | None = None,
                 seed: int = 0, runner: StepRunner | None = None, cuda_graphs: bool | None = None,
                 async_scheduling: bool | None = None) -> None:
        self.model = model
        self.plan = plan
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids)
        has_mamba = bool(plan.mamba_groups)
        self.coordinator = KVCacheCoordinator(plan, enable_prefix_caching=enable_prefix_caching,
                                              max_num_reqs=max_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=plan.max_model_len, align_prefill_chunks=has_mamba and enable_prefix_caching),
            self.coordinator)
        self.runner = runner if runner is not None else ModelRunner(
            model, plan, backend=backend, cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs)
        self._seeds = np.random.default_rng(seed)
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._num_prompt_logprob_requests = 0      # unfinished requests that want prompt logprobs
        self._steps = self._prompt_tokens = self._generated = 0
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

    # -- requests ------------------------------------------------------------------------------------
    def validate_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` with the reason a prompt cannot be served."""
        n = len(token_ids)
        if n == 0:
            raise RequestError("empty prompt")
        if n > self.plan.max_model_len:
            raise RequestError(f"prompt has {n} tokens, more than max_model_len={self.plan.max_model_len}")
        arr = np.asarray(token_ids)
        if not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() >= self.vocab_size:
            raise RequestError(f"token ids must be integers in [0, {self.vocab_size}), got "
                               f"min {arr.min()} max {arr.max()}")
        final = min(n + params.max_tokens, self.plan.max_model_len)
        if self.plan.attention_groups and self.coordinator.blocks_to_admit(final) > self._capacity_blocks:
            raise RequestError(f"a {final}-token request needs {self.coordinator.blocks_to_admit(final)} "
                               f"blocks; the KV cache holds {self._capacity_blocks}: raise kv_cache_memory")

    def add_request(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    *, prompt: str | None = None) -> None:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate_prompt(token_ids, params)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**62))
        req = Request(request_id=request_id, token_ids=[int(t) for t in token_ids],
                      num_prompt_tokens=len(token_ids), params=params, seed=seed,
                      arrival=next(self._arrivals), prompt=prompt)
        self._requests[request_id] = req
        self._num_prompt_logprob_requests += params.prompt_logprobs is not None
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        req.drop_pending()
        self._forget(req)
        return True

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._num_prompt_logprob_requests -= req.params.prompt_logprobs is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # -- one step --------------------------------------------------------------------------------------
    def step(self, *, only_finished: bool = False) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns an output for every request that advanced (streaming),
        or with ``only_finished`` for those that finished (building an output copies all of a request's
        tokens, which a non-streaming caller would throw away every step).

        With asynchronous scheduling the outputs are those of the previous step: this step is scheduled,
        built and queued on the device first, then the previous step's tokens are read (the device is
        busy meanwhile) and its requests advance."""
        batch = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        if batch.num_reqs == 0:
            if prev is not None:            # what is left waits for its last tokens: drain
                return self._finish(prev, only_finished=only_finished)[0]
            if self.scheduler.has_unfinished:
                raise RuntimeError("the scheduler made no progress: no request fits the KV cache")
            return []
        self._steps += 1
        src, dst = self.coordinator.take_state_copies()
        try:
            self.runner.copy_states(list(zip(src.tolist(), dst.tolist(), strict=True)))
            step = self._step_batch(batch, prev)
            out = self.runner.execute(step)
        except BaseException:
            self._inflight = prev       # its tokens stay readable; this step's tokens were never committed
            raise
        assert out is not None          # (None only on tensor-parallel ranks > 0, which run no engine)
        launched = self._launch(batch, step, out)
        outputs: list[RequestOutput] = []
        stopped = False
        if prev is not None:
            outputs, stopped = self._finish(prev, only_finished=only_finished)
        self._commit(batch, skip_finished=stopped)
        if self.async_scheduling:
            self._inflight = launched
        else:
            outputs += self._finish(launched, only_finished=only_finished)[0]
        return outputs

    def _step_batch(self, batch: ScheduledBatch, prev: _Launched | None = None) -> StepBatch:
        """The runner's view of ``batch``; a token still on its way from ``prev`` (the step in flight)
        is taken from ``prev.tokens`` on the device."""
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
            ids = np.fromiter(itertools.chain.from_iterable(
                r.token_ids[c:c + k] for r, c, k in zip(reqs, computed.tolist(), new.tolist(), strict=True)),
                np.int64, int(new.sum()))
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
                        or bool((sched.row_logprobs[rows] >= 0).any()))
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
        wants = np.fromiter((r.params.prompt_logprobs is not None for r in reqs), bool, n)
        lengths = np.where(wants, new, samples)
        starts = np.where(wants, ends - new, ends - 1)
        index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        return StepBatch(input_ids=ids, query_lens=new, seq_lens=seq_lens, block_tables=tables,
                         logits_indices=index.astype(np.int64), **extra)

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
        logits, greedy = out.logits, out.greedy
        prompt_logprobs = []
        if self._num_prompt_logprob_requests:        # logits rows of prompt chunks come first per request
            wants = np.array([r.params.prompt_logprobs is not None for r in reqs], bool)
            lengths = np.where(wants, new, samples)
            offsets = np.cumsum(lengths) - lengths
            sample_rows = (offsets + lengths - 1)[sample_idx]
            for i in np.flatnonzero(wants).tolist():
                chunk = self._prompt_logprobs(reqs[i], int(computed[i]), int(new[i]),
                                              logits[int(offsets[i]):int(offsets[i] + new[i])])
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
        else:
            assert logits is not None            # prompt logprobs: the step needed its logits
            index = torch.as_tensor(sample_rows, device=logits.device)
            picked, greedy = logits[index], (None if greedy is None else greedy[index])
        tokens, logprobs = self._sample(rows, picked, greedy)
        positions = sched.row_num_tokens[rows].copy()
        sched.add_sampled(rows)
        for r in samplers:
            r.token_ids.append(PENDING_TOKEN)
            r.num_pending += 1
        host, ready = self._to_host(tokens)
        return _Launched(batch=batch, samplers=samplers, rows=rows, positions=positions, tokens=tokens,
                         host=host, ready=ready, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

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
        whether any request finished."""
        tokens = launched.tokens_on_host()
        toks = tokens.tolist()
        lp = None if launched.logprobs is None else [t.tolist() for t in launched.logprobs]
        for chunk in launched.prompt_logprobs:
            if not chunk.request.finished:            # (aborted meanwhile)
                self._record_prompt_logprobs(chunk)
        sched = self.scheduler
        stopped: list[Request] = []
        gone = []                           # samplers whose row is no longer theirs
        for i, (r, p, tok) in enumerate(zip(launched.samplers, launched.positions.tolist(), toks, strict=True)):
            if r.finished:                  # stopped a step earlier, or aborted: the token is dropped
                gone.append(i)
                continue
            r.token_ids[p] = tok
            r.num_pending -= 1
            self._generated += 1
            if lp is not None and r.params.logprobs is not None:
                k = r.params.logprobs
                r.logprobs.append(TokenLogprob(token_id=tok, logprob=lp[0][i],
                                               top=tuple(zip(lp[2][i][:k], lp[1][i][:k], strict=True))))
            if r.kv_row < 0:                # preempted while its token was on its way
                gone.append(i)
            if self._stops(r, tok, p + 1):
                stopped.append(r)
        if gone:
            keep = np.ones(len(toks), bool)
            keep[gone] = False
            sched.set_last_tokens(launched.rows[keep], tokens[keep])
        else:
            sched.set_last_tokens(launched.rows, tokens)
        for r in stopped:
            r.drop_pending()
            sched.finish(r)
            self._forget(r)
        if only_finished:
            return [self.make_output(r) for r in stopped], bool(stopped)
        done = set(stopped)
        return [self.make_output(r) for r in launched.batch.requests if r in done or not r.finished], bool(stopped)

    def _sample(self, rows: np.ndarray, logits: torch.Tensor | None, greedy: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One token per sampling request (coordinator ``rows``, (B,)) on the device ((B,) int64), and
        the logprobs asked for; ``greedy``: the logits' argmax when the step computed it (``logits`` None: a
        greedy step that needed nothing else). The per-row parameters come from the scheduler's arrays: no
        loop over requests."""
        if logits is None:
            assert greedy is not None, "a step without logits returns its greedy tokens"
            return greedy, None
        device, sched = logits.device, self.scheduler
        knobs = sched.row_sampling[rows]                                   # (B, 3): temperature, top_p, min_p
        top_k = sched.row_top_k[rows]

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        if (knobs[:, 0] == 0).all():     # greedy batch: the argmax, no parameter tensors to ship
            tokens = logits.argmax(-1) if greedy is None else greedy
        else:
            st = SamplingTensors(
                temperature=dev(knobs[:, 0]), top_k=dev(top_k), top_p=dev(knobs[:, 1]), min_p=dev(knobs[:, 2]),
                seeds=dev(sched.row_seed[rows]),
                counters=dev(sched.row_num_tokens[rows] - sched.row_num_prompt[rows]),   # outputs so far
                needs_filtering=bool((top_k > 0).any() or (knobs[:, 1] < 1).any() or (knobs[:, 2] > 0).any()),
            )
            tokens = sample(logits, st)
        asked = sched.row_logprobs[rows]
        if not (asked >= 0).any():
            return tokens, None
        return tokens, _start_copy(logprobs_of(logits, tokens, int(asked.max())))

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
        """Whether ``tok``, the request's ``known``-th token, ends it (sets ``finish_reason``)."""
        p = r.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            r.finish_reason = "stop"
        elif p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(r.token_ids[r.num_prompt_tokens:known])
            if any(s in text for s in p.stop):
                r.finish_reason = "stop"
        if r.finish_reason is None and (known - r.num_prompt_tokens >= p.max_tokens
                                        or known >= self.plan.max_model_len):
            r.finish_reason = "length"
        return r.finish_reason is not None

    def make_output(self, r: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_token_ids)
            for s in r.params.stop:
                cut = text.find(s)
                if cut >= 0:
                    text = text[:cut]
        completion = CompletionOutput(index=0, token_ids=tuple(r.output_token_ids), text=text,
                                      finish_reason=r.finish_reason,
                                      logprobs=tuple(r.logprobs) if r.params.logprobs is not None else None)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=(completion,), finished=r.finished,
                             prompt_logprobs=(tuple(r.prompt_logprobs) if r.params.prompt_logprobs is not None
                                              else None))

    def reset_counters(self) -> None:
        """Zero the counters ``stats`` reports (after the start-up warm-up)."""
        self._steps = self._prompt_tokens = self._generated = 0
        self.scheduler.num_preemptions = 0
        self.coordinator.reset_stats()

    def stats(self) -> EngineStats:
        s = self.coordinator.stats
        return EngineStats(steps=self._steps, prompt_tokens=self._prompt_tokens,
                           generated_tokens=self._generated, preemptions=self.scheduler.num_preemptions,
                           prefix_hit_tokens=s.hit_tokens, prefix_query_tokens=s.query_tokens)

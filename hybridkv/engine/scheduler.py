"""Continuous batching over the hybrid KV cache.

Each step, under a token budget:

1. running requests first — 1-token continuations (decodes) ahead of prefill continuations — in one
   all-or-nothing ``allocate_batch``; when any group runs short, the latest arrival is preempted
   (its cache freed, its computed tokens forgotten: it is recomputed later) and the rest retried;
2. then waiting requests (preempted ones first, then by arrival): prefix-cache hit, admission check
   (the steady need of the request at its current length; the transient prefill extra is reserved
   once per step by the coordinator), allocation of a prefill chunk.

The batch comes out decodes first, which the Mamba builder relies on. While requests decode and some request
streams, the prompt tokens a step takes are capped (``prefill_spread``, ``_spread``): a burst of prompts runs
over several steps instead of stretching the streamed requests' next token. The cap is rounded up to the token count
the runner pads the step to (``step_sizes``: its graphs' buckets), whose padding rows would be computed anyway.

Shared prefixes. The coordinator indexes every unfinished prompt at arrival; a request's *stops* are the
ends of the prefixes it shares with others (``KVCacheCoordinator.prefix_stops``). The first request to be
admitted with a stop ahead *owns* it and computes it once; a waiting request whose shared prefix an owner
is still computing is passed over (later arrivals are admitted meanwhile) and joins as soon as the chunk
that reaches the stop is committed, together with every other such request, as a prefix hit. With Mamba
groups and prefix caching (``align_prefill_chunks``) a state exists only where a step ends, so prefill
chunks end at the stops, at the prompt's last block boundary, and otherwise on block boundaries: every
checkpoint a later request can use lands there (``StateManager``).
No request is ever lost or duplicated: every request is in exactly one of waiting / running / finished.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hybridkv.engine.request import Request, RequestStatus
from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.hashing import BlockHash

_max = np.maximum.reduce        # a direct ufunc reduction: ndarray.max goes through a Python wrapper
_NEVER = np.iinfo(np.int64).max
# A shared prefix is computed once (its sharers wait for it) when that saves at least a step's token budget:
# the wait costs the sharers about a step; a shorter one is computed by each of them in parallel.
STOP_MIN_SAVING = 1.0
# The lowest a spread step's prompt cap goes (``prefill_floor``; the step is then rounded up to its graph bucket). It
# must stay above the prompt tokens that arrive a step, or the queue stands and the cap runs at pending / spread:
# ~33 decodes + 192 round up to a 256-token step (~223 prompt tokens) against ~140-160 arriving at the Gemma-3-like
# half rate; 128 evened the NemotronH-like steps (~66 arriving) but fell behind those (docs/design.md).
DEFAULT_PREFILL_FLOOR = 192
DEFAULT_PREFILL_SPREAD = 8


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    align_prefill_chunks: bool = False     # end prefill chunks on block boundaries and at shared-prefix stops
    prefill_spread: int = DEFAULT_PREFILL_SPREAD    # while requests decode: prefill <= pending / this a step (_spread)
    prefill_floor: int = DEFAULT_PREFILL_FLOOR      # ... but never capped below this (_spread)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefill_spread", "prefill_floor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class ScheduledBatch:
    """One step's work, in batch order (decodes first)."""

    requests: list[Request]
    rows: np.ndarray              # (num_reqs,) coordinator rows
    num_new_tokens: np.ndarray    # (num_reqs,) tokens computed this step
    num_computed: np.ndarray      # (num_reqs,) tokens computed before this step
    preempted: list[Request] = field(default_factory=list)
    decode: bool = False          # known pure decode: every request computes just its one remaining token

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())


class Scheduler:
    def __init__(self, config: SchedulerConfig, coordinator: KVCacheCoordinator,
                 step_sizes: Sequence[int] = ()) -> None:
        """``step_sizes``: the token counts the runner pads a step to (its mixed graphs' buckets; empty: none)."""
        self.config = config
        self.coord = coordinator
        self.step_sizes = np.asarray(sorted(step_sizes), np.int64)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._queued: dict[Request, int] = {}       # waiting request -> its tokens to compute, counted at entry
        self._queued_tokens = 0                     # ... their sum (``prefill_spread``)
        self.num_preemptions = 0
        # Per coordinator row of a running request: tokens known and the last one (a decode's input).
        # ``add_sampled`` / ``set_last_tokens`` keep them current, so a step reads them with one gather,
        # never a loop over requests; the computed counts live in the coordinator (``num_computed_at``).
        self.row_num_tokens = np.zeros(coordinator.max_num_reqs, np.int64)
        self.row_last_token = np.zeros(coordinator.max_num_reqs, np.int64)
        self.row_num_prompt = np.zeros(coordinator.max_num_reqs, np.int64)
        # ... and what sampling reads: (temperature, top_p, min_p), top_k (0 = off), the effective seed, and
        # the number of logprobs asked (-1 = none).
        R = coordinator.max_num_reqs
        self.row_sampling = np.zeros((R, 3), np.float32)
        self.row_top_k = np.zeros(R, np.int64)
        self.row_seed = np.zeros(R, np.int64)
        self.row_logprobs = np.full(R, -1, np.int64)          # -1: none asked
        # Asynchronous scheduling: the length at which a request finishes whatever it samples (max_tokens or
        # max_model_len), so one whose last token is still on its way is not scheduled again; and where a
        # row's last token sits in the in-flight step's sampled tokens (-1: on the host).
        self.row_final = np.zeros(R, np.int64)
        self.row_pending = np.full(R, -1, np.int64)
        self._arange = np.arange(R, dtype=np.int64)
        self._running_rows: np.ndarray | None = None      # rows of ``running``; None once it changes
        # Shared prefixes: each request's stops (cached per sharing generation) and who computes each
        # stop's prefix.
        self._stops: dict[Request, tuple[int, list[tuple[int, BlockHash]]]] = {}
        self._owner: dict[BlockHash, Request] = {}
        self._claims: dict[Request, list[BlockHash]] = {}
        # Where a state can be checkpointed: multiples of the Mamba block size (align mode).
        self._ckpt_bs = coordinator.state.block_size if coordinator.state else coordinator.block_size

    # -- queue management --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.coord.add_waiting(request.request_id, request.token_ids)
        self._enqueue(request)

    def _enqueue(self, request: Request, *, first: bool = False) -> None:
        if first:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        n = self._queued[request] = request.num_tokens
        self._queued_tokens += n

    def _dequeued(self, request: Request) -> None:
        """(after ``request`` left ``waiting``)"""
        self._queued_tokens -= self._queued.pop(request)

    def pop_waiting(self) -> Request:
        """The first waiting request, out of the queue (benchmarks that admit requests by hand)."""
        request = self.waiting.popleft()
        self._dequeued(request)
        return request

    @property
    def queued_tokens(self) -> int:
        """The waiting requests' tokens to compute, as counted when they entered the queue."""
        return self._queued_tokens

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its cache; returns it (None if unknown)."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    if queue is self.waiting:
                        self._dequeued(req)
                    self._running_rows = None
                    self._end(req)
                    req.finish_reason = "abort"
                    return req
        return None

    def finish(self, request: Request) -> None:
        """Called by the engine once a request has finished: frees its cache. A request preempted while
        its last token was on its way finishes from the waiting queue."""
        if request.status is RequestStatus.PREEMPTED:
            self.waiting.remove(request)
            self._dequeued(request)
        else:
            self.running.remove(request)
            self._running_rows = None
        self._end(request)

    def _end(self, request: Request) -> None:
        self.coord.free(request.request_id)
        self.coord.forget(request.request_id)
        self._release_claims(request)
        # (with its chain out of the index: a generation restarts at 1 once every chain with its first block is gone,
        # so a cached one must not outlive the request, ``SharedPrefixIndex.remove``)
        self._stops.pop(request, None)
        request.status = RequestStatus.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------------
    def _chunk(self, num_computed: int, remaining: int, budget: int, stop: int = _NEVER) -> int:
        """Tokens to compute for a request this step. With ``align_prefill_chunks`` (Mamba groups and
        prefix caching) a chunk ends where a checkpoint can be taken: at ``stop`` (a shared prefix's end or
        the prompt's last block boundary, ``_next_stop``) when it reaches it, else an unfinished chunk is
        rounded down to a block boundary (the remaining < block_size tokens run next step)."""
        n = min(remaining, budget)
        if self.config.align_prefill_chunks and n > 1:
            end = num_computed + n
            if num_computed < stop <= end:
                return stop - num_computed
            if n < remaining:
                bs = self._ckpt_bs
                aligned = end // bs * bs - num_computed
                n = aligned if aligned > 0 else n
        return n

    # -- shared prefixes ---------------------------------------------------------------------------------
    def _request_stops(self, req: Request) -> list[tuple[int, BlockHash]]:
        """(length, key) of the request's shared-prefix stops worth a step (cached until the requests that
        could share with it change): those whose prefix saves ``STOP_MIN_SAVING`` x a step's token budget
        (length x other sharers)."""
        gen = self.coord.stops_generation(req.request_id)
        cached = self._stops.get(req)
        if cached is None or cached[0] != gen:
            least = self.config.max_num_batched_tokens * STOP_MIN_SAVING
            stops = [(length, key) for length, key, sharers in self.coord.prefix_stops(req.request_id)
                     if length * (sharers - 1) >= least]
            cached = self._stops[req] = (gen, stops)
        return cached[1]

    def _next_stop(self, req: Request, num_computed: int) -> int:
        """Where the request's next prefill chunk must end (align mode): its next shared-prefix stop or its
        prompt's last block boundary, whichever comes first after ``num_computed`` (_NEVER: none)."""
        if not self.config.align_prefill_chunks:
            return _NEVER
        stop = (req.num_tokens - 1) // self._ckpt_bs * self._ckpt_bs
        if stop <= num_computed:
            stop = _NEVER
        for length, _ in self._request_stops(req):
            if length > num_computed:
                return min(length, stop)
        return stop

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether another running request is still computing a prefix this one shares (then this one
        starts from it once it is cached instead of computing it again)."""
        for length, key in self._request_stops(req):
            owner = self._owner.get(key)
            if owner is not None and owner is not req and owner.status is RequestStatus.RUNNING \
                    and self.coord.num_computed_tokens(owner.request_id) < length:
                return True
        return False

    def _claim(self, req: Request, num_computed: int) -> None:
        """``req`` computes the shared prefixes it reaches beyond ``num_computed`` that nobody else is on."""
        claims = None
        for length, key in self._request_stops(req):
            if length <= num_computed:
                continue
            owner = self._owner.get(key)
            if owner is None or owner.status is not RequestStatus.RUNNING \
                    or self.coord.num_computed_tokens(owner.request_id) >= length:
                self._owner[key] = req
                if claims is None:
                    claims = self._claims.setdefault(req, [])
                claims.append(key)

    def _release_claims(self, req: Request) -> None:
        for key in self._claims.pop(req, ()):
            if self._owner.get(key) is req:
                del self._owner[key]

    def mark_running(self, req: Request) -> None:
        """Move a request the coordinator already holds (allocated) into ``running`` at its arrival
        position."""
        req.kv_row = row = self.coord.row_of(req.request_id)
        req.status = RequestStatus.RUNNING
        self.row_num_tokens[row] = req.num_tokens
        self.row_num_prompt[row] = req.num_prompt_tokens
        p = req.params
        self.row_sampling[row] = (p.temperature, p.top_p, p.min_p)
        self.row_top_k[row] = max(p.top_k, 0)
        self.row_seed[row] = req.seed
        self.row_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.row_last_token[row] = req.token_ids[-1]
        # (at least one output: a prompt of max_model_len tokens still samples one)
        self.row_final[row] = max(min(req.num_prompt_tokens + p.max_tokens, self.config.max_model_len),
                                  req.num_prompt_tokens + 1)
        self.row_pending[row] = -1
        self.coord.set_final_length(req.request_id, int(self.row_final[row]))
        bisect.insort(self.running, req, key=lambda r: r.arrival)
        self._running_rows = None

    def add_sampled(self, rows: np.ndarray) -> None:
        """The engine sampled one token on the device for each of the running requests at coordinator
        ``rows`` (B,), in that order: counted now, their values known after ``set_last_tokens``."""
        self.row_num_tokens[rows] += 1
        self.row_pending.fill(-1)
        self.row_pending[rows] = self._arange[:rows.shape[0]]

    def set_last_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """The values (B,) of the tokens ``add_sampled`` counted for ``rows`` (B,)."""
        self.row_last_token[rows] = tokens

    @property
    def running_rows(self) -> np.ndarray:
        """(len(running),) int64 coordinator rows of the running requests, in arrival order."""
        if self._running_rows is None:
            self._running_rows = np.fromiter((r.kv_row for r in self.running), np.int64, len(self.running))
        return self._running_rows

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._running_rows = None
        request.kv_row = -1
        self.coord.free(request.request_id)
        self._release_claims(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, first=True)

    def _running_step(self, budget: int, spread: bool
                      ) -> tuple[list[Request], np.ndarray, np.ndarray, np.ndarray, bool, int]:
        """(requests, tokens to compute, coordinator rows, computed so far, whether all are decodes, the step's
        budget) for the running requests, decodes first then by arrival, within ``budget``, less the prefill
        cap of ``prefill_spread`` when ``spread`` and some of them decode (the budget returned, for the waiting
        ones too).

        Vectorised: earlier requests take all they need, the first that does not fit takes the rest of
        the budget (a partial prefill chunk, block-aligned when asked), later ones wait."""
        running, rows = self.running, self.running_rows
        computed = self.coord.num_computed_at(rows)
        known = self.row_num_tokens[rows]
        rem = known - computed
        done = known >= self.row_final[rows]      # its last sampled token is on its way: nothing left to run
        if np.count_nonzero(done):
            rem[done] = 0
        if spread:
            budget = self._spread(budget, rem, known > self.row_num_prompt[rows])
        if rem.shape[0] <= budget and _max(rem) <= 1 and np.count_nonzero(rem) == rem.shape[0]:
            return list(running), rem, rows, computed, True, budget    # all decodes, all fit (the steady state)
        prefill = rem > 1
        if self.config.align_prefill_chunks and prefill.any():    # prefill chunks end at their stops
            for i in np.flatnonzero(prefill).tolist():
                stop = self._next_stop(running[i], int(computed[i]))
                if stop - computed[i] < rem[i]:
                    rem[i] = stop - computed[i]
        if prefill.any() and not prefill.all():            # running is in arrival order: decodes first
            order = np.argsort(prefill, kind="stable")
            rem, rows, computed = rem[order], rows[order], computed[order]
            running = [running[i] for i in order.tolist()]
        take = np.minimum(np.maximum(budget - (np.cumsum(rem) - rem), 0), rem)
        partial = np.flatnonzero((take > 0) & (take < rem))
        if partial.size and self.config.align_prefill_chunks:
            i = int(partial[0])
            take[i] = self._chunk(int(computed[i]), int(rem[i]), int(take[i]))
        keep = take > 0
        if keep.all():
            return list(running), take, rows, computed, False, budget
        return ([running[i] for i in np.flatnonzero(keep).tolist()], take[keep], rows[keep], computed[keep], False,
                budget)

    def _spread(self, budget: int, rem: np.ndarray, generating: np.ndarray) -> int:
        """``budget`` capped, while any of the running requests decodes (``rem``: their tokens to compute;
        ``generating``: whether each is past its prompt, so a prompt's one-token tail is no decode), at the decodes
        plus max(``prefill_floor``, the pending prompt tokens (running and waiting) / ``prefill_spread``), rounded
        up to the next of ``step_sizes``: the step runs padded to that size, so the padding's rows take prompt
        tokens at no extra cost in the GEMMs (at half the serving rate: a shorter mean step, its p90 and first
        tokens, ``docs/design.md``).

        A burst of arrivals then spreads its prefill over several steps instead of stretching one step, which
        every decoding request would wait through; the pending tokens grow with the queue, so under serving load
        the cap reaches the budget. The cost is steps: a steady trickle's first tokens come ~``prefill_spread``
        steps later, and a large burst's last ones more (what is left shrinks by 1/``prefill_spread`` a step down
        to the floor), which is why only steps with a streamed request spread (``schedule``)."""
        spread, floor = self.config.prefill_spread, self.config.prefill_floor
        decodes = int(np.count_nonzero((rem == 1) & generating))
        if spread == 1 or not decodes:
            return budget
        pending = int(rem.sum()) - decodes + self._queued_tokens
        cap = decodes + max(floor, -(-pending // spread))
        sizes = self.step_sizes
        if sizes.size and cap <= sizes[-1]:
            cap = int(sizes[np.searchsorted(sizes, cap)])
        return min(budget, cap)

    def schedule(self, *, spread: bool = False) -> ScheduledBatch:
        """The next step's batch; ``spread``: cap its prompt tokens while requests decode (``_spread``; the engine
        asks it while some request streams, whose next tokens a long step would delay: a batch whose outputs come
        only at the end takes its full budget)."""
        budget = self.config.max_num_batched_tokens
        preempted: list[Request] = []
        chosen: list[Request] = []
        empty = np.zeros(0, np.int64)
        counts, rows, computed = empty, empty, empty
        decode = False
        # 1. running requests, decodes first; preempt latest arrivals until the allocation fits.
        while self.running:
            chosen, counts, rows, computed, decode, budget = self._running_step(self.config.max_num_batched_tokens,
                                                                                spread)
            if self.coord.allocate_batch(rows, computed, counts):
                break
            victim = self.running[-1]                       # the latest arrival
            self._preempt(victim)
            preempted.append(victim)
            chosen, counts, rows, computed, decode = [], empty, empty, empty, False
            budget = self.config.max_num_batched_tokens
        budget -= int(counts.sum())
        num_running = len(chosen)
        new_counts: list[int] = []
        new_computed: list[int] = []
        sharing = self.coord.enable_prefix_caching

        # 2. waiting requests (a just-preempted request waits for a later step). One whose shared prefix
        # another request is computing is passed over: it joins once that prefix is cached.
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if req in preempted:
                break
            rid = req.request_id
            lookup = sharing and req.params.prompt_logprobs is None
            if lookup and self._waits_for_prefix(req):
                i += 1
                continue
            if not self.coord.can_admit(req.num_tokens, num_cached_tokens=req.num_tokens - 1):
                break           # would not fit even if all but its last token were cached: skip the lookup
            hit = self.coord.find_prefix_hit(rid, req.token_ids) if lookup else 0
            # Admit on the current need (what the prompt holds after its prefill); growth while
            # decoding is met by preempting the latest arrival, as in vLLM: it keeps batches full.
            if not self.coord.can_admit(req.num_tokens, num_cached_tokens=hit, request_id=rid):
                self.coord.free(rid)
                break
            n = self._chunk(hit, req.num_tokens - hit, budget, self._next_stop(req, hit))
            if not self.coord.allocate(rid, num_computed_tokens=hit, num_new_tokens=n, token_ids=req.token_ids):
                self.coord.free(rid)
                break
            del self.waiting[i]
            self._dequeued(req)
            self.mark_running(req)
            if sharing:
                self._claim(req, hit)
            chosen.append(req)
            new_counts.append(n)
            new_computed.append(hit)
            budget -= n

        if new_counts:
            admitted = chosen[num_running:]
            rows = np.concatenate([rows, np.fromiter((r.kv_row for r in admitted), np.int64, len(admitted))])
            computed = np.concatenate([computed, np.asarray(new_computed, np.int64)])
            counts = np.concatenate([counts, np.asarray(new_counts, np.int64)])
            decode = False
        return ScheduledBatch(requests=chosen, rows=rows, num_new_tokens=counts, num_computed=computed,
                              preempted=preempted, decode=decode)

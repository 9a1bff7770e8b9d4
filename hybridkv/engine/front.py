"""``EngineFront``: one ``LLMEngine`` shared by any number of threads and event loops.

The engine is not thread-safe; the front makes it so without a lock around every call:

- **Submissions and aborts go into an inbox** (a few appends under a short lock, never waiting for a step).
  The thread that drives the engine applies the inbox at the next step boundary, so a cancelled consumer's
  request is aborted, and its blocks and state slots freed, before the next step is scheduled.
- **One thread at a time drives** (schedules, runs, samples) — whoever needs outputs and finds nobody driving:
  ``AsyncLLM``'s engine thread while it has requests, or a thread inside ``LLM.generate`` / ``generate_stream``.
  A lone ``LLM.generate`` therefore steps the engine in its own thread exactly as an engine without a front
  would (no hand-off per step: offline throughput unchanged), and several threads share the steps: each
  step's outputs go to the consumers that own them (``Sink``), whichever thread ran it.
- **Outputs are routed** by request id to their sink; a sink hears nothing of a request after aborting it.

A driver that stops driving first applies what the inbox holds, so an abort never waits for the next caller.
An exception raised by a step propagates to the thread that drove it (as ``LLMEngine.step`` raises it); the
step's failed requests reach their sinks with the next step. When the engine can no longer run (a
``ENGINE_FATAL`` error in ``serve``), every live request gets an error output and new submissions fail.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hybridkv.engine.engine import LLMEngine, RequestError
from hybridkv.engine.request import OutputKind, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams

logger = logging.getLogger("hybridkv.engine")

_T = TypeVar("_T")


class EngineDeadError(RuntimeError):
    """The engine can no longer run requests (a fatal step error, or it was shut down)."""


class Sink(Protocol):
    """Where a consumer's outputs go. ``deliver`` runs in the driving thread with the front's lock held: it
    must only hand the outputs over (append to a queue, wake a loop), never wait or call the front."""

    def deliver(self, outputs: list[RequestOutput]) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Submission:
    """One engine request (one of a prompt's ``n`` samples), already validated by the submitter."""

    request_id: str
    token_ids: Sequence[int]
    params: SamplingParams
    prompt: str | None = None
    output_kind: OutputKind = OutputKind.FINAL


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """What the engine holds and has done, read at a step boundary (``EngineFront.snapshot``)."""

    running: int
    waiting: int                                   # queued in the engine or in the inbox, preempted included
    steps: int
    step_seconds: tuple[int, ...]                  # per ``STEP_SECONDS_BUCKETS`` bound (``EngineStats``)
    step_seconds_sum: float
    prompt_tokens: int                             # prompt tokens computed (recomputation included)
    generated_tokens: int
    preemptions: int
    kv_usage: dict[int, float]                     # group id -> share of its pool in use
    group_kinds: dict[int, str]                    # group id -> its layer kind
    prefix_query_tokens: int                       # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int                         # ... found there (the hybrid hit: every group accepts it)
    prefix_queries: dict[int, int]                 # group id -> prompt tokens looked up, by that group
    prefix_hits: dict[int, int]                    # group id -> ... that that group holds


@dataclass(eq=False)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future = field(default_factory=Future)


class EngineFront:
    """The thread-safe front of ``engine`` (module docstring). ``LLM`` and ``AsyncLLM`` are its clients."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._queued = 0                            # submissions in the inbox
        self._driver: int | None = None             # ident of the thread driving the engine
        self._owners: dict[str, Sink] = {}          # engine request id -> its sink
        self._dead: str | None = None               # why the engine cannot run any more

    # -- consumers --------------------------------------------------------------------------------
    def validate(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """``RequestError`` with the reason ``token_ids`` / ``params`` cannot be served (the checks read only
        what never changes: the plan, the vocabulary, the tokenizer; any thread may call this)."""
        self.engine.validate_prompt(token_ids, params)

    def submit(self, submissions: Sequence[Submission], sink: Sink) -> None:
        """Queue validated requests whose outputs go to ``sink``; they enter the engine at the next step
        boundary (a request the engine still refuses then gets an error output)."""
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            for s in submissions:
                if s.request_id in self._owners:
                    raise RequestError(f"request id {s.request_id!r} is already in use")
            for s in submissions:
                self._owners[s.request_id] = sink
            self._inbox.append(("add", list(submissions)))
            self._queued += len(submissions)
            self._cond.notify_all()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests wherever they are; their sinks get nothing more. Applied at the next step boundary,
        at once when no thread is driving."""
        if not request_ids:
            return
        with self._cond:
            for rid in request_ids:
                self._owners.pop(rid, None)
            self._inbox.append(("abort", list(request_ids)))
            claimed = self._claim()
            if not claimed:
                self._cond.notify_all()
        if claimed:
            self._release()

    def requests_of(self, sink: Sink) -> list[str]:
        """The live requests whose outputs go to ``sink``."""
        with self._cond:
            return [rid for rid, owner in self._owners.items() if owner is sink]

    def drive(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` (evaluated with the lock held, after each delivery); meanwhile step the engine
        in this thread whenever no other thread does. Raises what a step it drove raised."""
        with self._cond:
            while not done():
                if self._claim():
                    break
                self._cond.wait()
            else:
                return
        try:
            while True:
                self._step()
                with self._cond:
                    if done():
                        return
                    if not self._inbox and not self.engine.has_unfinished:
                        raise RuntimeError("the engine lost requests its caller waits for")
        finally:
            self._release()

    def num_waiting(self) -> int:
        """Requests submitted and not yet running (an estimate while another thread drives)."""
        return self._queued + len(self.engine.scheduler.waiting)

    @property
    def dead(self) -> str | None:
        """Why the engine can run nothing more (None while it can)."""
        return self._dead

    def at_step_boundary(self, fn: Callable[[LLMEngine], _T]) -> Future[_T]:
        """``fn(engine)`` run between two steps by the driving thread, or at once in this thread when none
        drives; its result (or exception) in the returned future."""
        call = _Call(fn=fn)
        with self._cond:
            claimed = self._claim()
            if not claimed:
                self._inbox.append(("call", call))
                self._cond.notify_all()
        if claimed:
            try:
                self._run_call(call)
            finally:
                self._release()
        return call.future

    def snapshot(self) -> Future[EngineSnapshot]:
        return self.at_step_boundary(_snapshot)

    # -- the engine thread ------------------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Drive the engine whenever it has work and no other thread drives it, until ``stop`` is set and no
        work is left. A step error that escapes ``LLMEngine.step`` (it contains what one request can cause)
        leaves no working engine: every live request fails and the front is dead."""
        while True:
            with self._cond:
                while self._driver is not None or not (self._inbox or self.engine.has_unfinished):
                    if stop.is_set() and self._driver is None:
                        return
                    self._cond.wait(timeout=0.5)
                self._claim()
            try:
                while True:
                    self._step()
                    with self._cond:
                        if not (self._inbox or self.engine.has_unfinished):
                            break
            except Exception as exc:
                logger.critical("the engine failed and cannot serve any more requests: %s: %s",
                                type(exc).__name__, exc, exc_info=exc)
                self._die(f"the engine failed ({type(exc).__name__}: {exc})")
                return
            finally:
                self._release()

    def wake(self) -> None:
        """Wake ``serve`` to look at its stop event now."""
        with self._cond:
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """Refuse new requests; abort every live one (its sink gets an error output saying ``reason``)."""
        with self._cond:
            claimed = self._claim()
        self._die(reason)
        if claimed:
            self._release()

    # -- internals ---------------------------------------------------------------------------------
    def _claim(self) -> bool:
        """Become the driver if nobody is (lock held)."""
        if self._driver is None:
            self._driver = threading.get_ident()
            return True
        return False

    def _release(self) -> None:
        """Stop driving, after applying what the inbox holds (lock not held)."""
        while True:
            self._apply_inbox()
            with self._cond:
                if not self._inbox:
                    self._driver = None
                    self._cond.notify_all()
                    return

    def _step(self) -> None:
        self._apply_inbox()
        if self.engine.has_unfinished:
            self._route(self.engine.step())

    def _apply_inbox(self) -> None:
        with self._cond:
            todo, self._inbox = self._inbox, deque()
        engine = self.engine
        failed: list[RequestOutput] = []
        for kind, payload in todo:
            if kind == "add":
                with self._cond:
                    self._queued -= len(payload)
                for s in payload:
                    if s.request_id not in self._owners:
                        continue                           # aborted before it was added
                    try:
                        engine.add_request(s.request_id, s.token_ids, s.params, prompt=s.prompt,
                                           output_kind=s.output_kind)
                    except RequestError as err:
                        failed.append(_error_output(s, str(err)))
            elif kind == "abort":
                for rid in payload:
                    engine.abort(rid)
            else:
                self._run_call(payload)
        if failed:
            self._route(failed)

    def _run_call(self, call: _Call) -> None:
        try:
            call.future.set_result(call.fn(self.engine))
        except Exception as exc:
            call.future.set_exception(exc)

    def _route(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._cond:
            by_sink: dict[int, tuple[Sink, list[RequestOutput]]] = {}
            for out in outputs:
                sink = self._owners.get(out.request_id)
                if sink is None:
                    continue                       # aborted, or added to the engine directly
                if out.finished:
                    del self._owners[out.request_id]
                by_sink.setdefault(id(sink), (sink, []))[1].append(out)
            for sink, outs in by_sink.values():
                sink.deliver(outs)
            self._cond.notify_all()

    def _die(self, reason: str) -> None:
        """Dead: the inbox's submissions dropped, its calls failed, every owned request aborted (by the driver,
        when it next applies the inbox) with an error output to its sink."""
        with self._cond:
            self._dead = reason
            owners, self._owners = self._owners, {}
            for kind, payload in self._inbox:
                if kind == "call":
                    payload.future.set_exception(EngineDeadError(reason))
            self._inbox = deque([("abort", list(owners))])
            self._queued = 0
            by_sink: dict[int, tuple[Sink, list[RequestOutput]]] = {}
            for rid, sink in owners.items():
                out = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=(), outputs=(), finished=True,
                                    error=reason)
                by_sink.setdefault(id(sink), (sink, []))[1].append(out)
            for sink, outs in by_sink.values():
                sink.deliver(outs)
            self._cond.notify_all()


def _error_output(s: Submission, error: str) -> RequestOutput:
    return RequestOutput(request_id=s.request_id, prompt=s.prompt, prompt_token_ids=tuple(s.token_ids),
                         outputs=(), finished=True, error=error)


def _snapshot(engine: LLMEngine) -> EngineSnapshot:
    stats = engine.stats()
    coord = engine.coordinator
    groups = engine.plan.groups
    per_group = coord.group_stats()
    return EngineSnapshot(
        running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), steps=stats.steps,
        step_seconds=stats.step_seconds, step_seconds_sum=stats.step_seconds_sum,
        prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens, preemptions=stats.preemptions,
        prefix_query_tokens=stats.prefix_query_tokens, prefix_hit_tokens=stats.prefix_hit_tokens,
        kv_usage=coord.usage(), group_kinds={g.group_id: g.spec.kind for g in groups},
        prefix_queries={gid: s.query_tokens for gid, s in per_group.items()},
        prefix_hits={gid: s.hit_tokens for gid, s in per_group.items()})

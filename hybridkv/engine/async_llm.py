"""``AsyncLLM``: the engine served to coroutines by a dedicated engine thread.

    llm = LLM("path/to/checkpoint")
    engine = AsyncLLM(llm)                                   # starts the engine thread
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(out.outputs[0].text, end="")                   # the new text of each step
    engine.shutdown()

The engine thread drives the engine (``EngineFront.serve``) whenever it has requests; coroutines of any
number of event loops submit requests and receive their outputs through ``RequestStream``s, woken once per
engine step per event loop (one ``call_soon_threadsafe`` a step, whatever the number of streams). A stream
whose consumer is cancelled (a client gone, a task cancelled) or that is closed aborts its request at the
next step boundary, which frees its blocks and state slots. The ``LLM`` given keeps working from any thread
(its calls share the engine's steps with the engine thread).

Streamed outputs are deltas: each holds, per sample that advanced, the token ids, text and logprobs new
since the last one (several steps' worth when the consumer is slower than the engine); text comes from an
incremental detokenizer, held back where it could begin a stop string, and completed from the final text.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.front import EngineDeadError, EngineSnapshot
from hybridkv.engine.llm import LLM, Prompt, merge_samples, sample_submissions
from hybridkv.engine.request import CompletionOutput, OutputKind, RequestMetrics, RequestOutput, TokenLogprob
from hybridkv.engine.sampling_params import SamplingParams

logger = logging.getLogger("hybridkv.engine")

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "RequestStream"]


class QueueFullError(RuntimeError):
    """More requests wait for the engine than ``max_waiting`` allows; retry later."""


class AsyncLLM:
    """``llm``'s engine served by a dedicated thread to coroutines. ``max_waiting``: the most requests that
    may wait to be scheduled (preempted ones included); a submission beyond it raises ``QueueFullError``
    (None: no bound)."""

    def __init__(self, llm: LLM, *, max_waiting: int | None = None) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive int or None, got {max_waiting!r}")
        self.llm = llm
        self.front = llm.front
        self.max_waiting = max_waiting
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
        self._closing: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybridkv-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        device = self.llm.engine.device
        if device.type == "cuda":
            torch.cuda.set_device(device)        # (the current device is per thread)
        self.front.serve(self._stop)

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.engine.vocab_size

    def decode(self, ids: Sequence[int], params: SamplingParams) -> str:
        """Text of token ids as a request with ``params`` gets it (needs a tokenizer)."""
        return self.llm.engine.decode(ids, params)

    def render_chat(self, messages: Sequence[Any], **options: Any) -> str:
        """One conversation as its prompt text (``LLM.render_chat``)."""
        return self.llm.render_chat(messages, **options)

    @property
    def dead(self) -> str | None:
        """Why no request can be served any more (None while requests are taken)."""
        return self._closing or self.front.dead

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               stream: bool = True) -> RequestStream:
        """Queue ``prompt`` (text, token ids or a prompt dict) with ``params`` (its ``n`` samples) and return
        its ``RequestStream``; call it from the event loop that will read the stream. Raises at once:
        ``RequestError`` (a prompt or params that cannot be served), ``QueueFullError`` (``max_waiting``
        reached), ``EngineDeadError`` (shut down, or the engine failed). ``stream``: deltas after each step
        (else one output, when every sample has finished)."""
        loop = asyncio.get_running_loop()
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        params = SamplingParams() if params is None else params
        parsed = self.llm.parse_prompt(prompt)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        kind = OutputKind.DELTA if stream else OutputKind.FINAL
        submissions = sample_submissions(self.front.validate, rid, parsed, params, kind)
        if self.max_waiting is not None and self.front.num_waiting() + len(submissions) > self.max_waiting:
            raise QueueFullError(f"{self.front.num_waiting()} requests are waiting (max_waiting="
                                 f"{self.max_waiting}); retry later")
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = LoopWaker(loop)
        token_ids = tuple(int(t) for t in submissions[0].token_ids)
        result = RequestStream(self.front.abort, waker, rid, prompt=parsed.text, prompt_token_ids=token_ids,
                               params=params, sample_ids=[s.request_id for s in submissions], stream=stream,
                               decode=self.decode if self.llm.tokenizer is not None else None)
        self.front.submit(submissions, result)
        return result

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The deltas of ``prompt``'s samples as they come (``submit`` says what raises); leaving the loop
        early or being cancelled aborts the request."""
        result = self.submit(prompt, params, request_id=request_id)
        try:
            async for out in result:
                yield out
        finally:
            result.abort()

    async def snapshot(self) -> EngineSnapshot:
        """What the engine holds and has done (read between two steps)."""
        return await asyncio.wrap_future(self.front.snapshot())

    # -- life cycle -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Take no more requests; let the running ones finish for up to ``timeout`` seconds, then abort what is
        left (its streams end with an error); stop the engine thread. The ``LLM`` stays usable."""
        if self._closing is None:
            self._closing = "the server is shutting down"
        self._stop.set()
        self.front.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("shutdown: requests still running after %.0f s are aborted", timeout)
            self.front.close(self._closing)
            self._thread.join(timeout)


@dataclass(eq=False)
class _Sample:
    detokenizer: IncrementalDetokenizer | None
    num_tokens: int = 0                     # output tokens handed out
    num_logprobs: int = 0
    finished: bool = False
    final: RequestOutput | None = None


@dataclass(eq=False)
class _Delta:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestStream:
    """The outputs of one submitted prompt (an async iterator; a ``Sink`` of the engine front). Iterating
    gives deltas (``submit(stream=True)``) or one merged output; a consumer cancelled while it waits aborts
    the request, as ``abort()`` and leaving ``async with`` do. Once it has finished, ``metrics`` holds each
    sample's ``RequestMetrics``, ``num_output_tokens`` their total length."""

    def __init__(self, abort: Callable[[Sequence[str]], None], waker: LoopWaker, request_id: str, *,
                 prompt: str | None, prompt_token_ids: tuple[int, ...], params: SamplingParams,
                 sample_ids: Sequence[str], stream: bool,
                 decode: Callable[[Sequence[int], SamplingParams], str] | None) -> None:
        self._abort = abort                   # aborts engine requests (their ids) at the next step boundary
        self._waker = waker
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream
        self._ids = list(sample_ids)
        self._live = set(sample_ids)
        self._samples: dict[str, _Sample] = {}
        for rid in sample_ids:
            detok = None
            if stream and decode is not None:
                detok = IncrementalDetokenizer(lambda ids: decode(ids, params), stop=params.stop)
            self._samples[rid] = _Sample(detokenizer=detok)
        self._pending: deque[RequestOutput] = deque()     # filled by the routing thread (deliver)
        self._event = asyncio.Event()
        self._finished = False
        self.metrics: dict[int, RequestMetrics] = {}
        self.finish_reasons: dict[int, str | None] = {}
        self.num_output_tokens = 0
        self.num_cached_tokens: int | None = None
        self.error: str | None = None

    # Sink (the thread that routes engine outputs: the engine thread with the front's lock held, or the reader
    # thread of an engine process)
    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._pending.extend(outputs)
        self._waker.wake(self)

    @property
    def finished(self) -> bool:
        return self._finished

    def abort(self) -> None:
        """Abort what is still running (idempotent); the stream ends."""
        if self._live:
            live, self._live = sorted(self._live), set()
            self._abort(live)
        self._finished = True
        self._event.set()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._pending:
                out = self._take()
                if out is not None:
                    return out
                continue
            if self._finished:
                raise StopAsyncIteration
            self._event.clear()
            if self._pending:
                continue
            try:
                await self._event.wait()
            except asyncio.CancelledError:
                self.abort()
                raise

    async def result(self) -> RequestOutput:
        """Wait for the end; the last output (merged: every sample whole, when not streaming)."""
        last = None
        async for out in self:
            last = out
        if last is None:
            raise EngineDeadError("the request was aborted")
        return last

    # -- turning engine outputs into this stream's outputs ------------------------------------------
    def _take(self) -> RequestOutput | None:
        outs = list(self._pending)
        for _ in outs:
            self._pending.popleft()
        for out in outs:
            if out.finished:
                self._live.discard(out.request_id)
                self._finish_sample(out)
        if not self._live and all(s.finished for s in self._samples.values()):
            self._finished = True
        if not self.stream:
            if not self._finished:
                return None
            finals = {i: self._samples[rid].final for i, rid in enumerate(self._ids)}
            return merge_samples(self.request_id, finals)       # type: ignore[arg-type]
        return self._deltas(outs)

    def _finish_sample(self, out: RequestOutput) -> None:
        sample = self._samples.get(out.request_id)
        if sample is None or sample.finished:
            return
        sample.finished = True
        if not out.outputs:          # refused when it reached the engine, or the engine died: an error only
            out = replace(out, outputs=(CompletionOutput(index=0, token_ids=(), text="" if self.stream else None,
                                                         finish_reason="error"),))
        sample.final = out
        index = self._ids.index(out.request_id)
        self.finish_reasons[index] = out.outputs[0].finish_reason
        if out.metrics is not None:
            self.metrics[index] = out.metrics
        self.num_output_tokens += len(out.outputs[0].token_ids)
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = max(self.num_cached_tokens or 0, out.num_cached_tokens)
        if out.error is not None and self.error is None:
            self.error = out.error

    def _deltas(self, outs: list[RequestOutput]) -> RequestOutput | None:
        deltas: dict[str, _Delta] = {}
        prompt_logprobs = None
        for out in outs:
            sample = self._samples.get(out.request_id)
            if sample is None or not out.outputs:
                if sample is not None:
                    deltas.setdefault(out.request_id, _Delta()).finish_reason = "error"
                continue
            c = out.outputs[0]
            d = deltas.setdefault(out.request_id, _Delta())
            new_ids = c.token_ids[sample.num_tokens:] if out.finished else c.token_ids
            sample.num_tokens += len(new_ids)
            d.token_ids += new_ids
            if c.logprobs is not None:
                new_lp = c.logprobs[sample.num_logprobs:] if out.finished else c.logprobs
                sample.num_logprobs += len(new_lp)
                d.logprobs += new_lp
            if sample.detokenizer is not None:
                d.text.append(sample.detokenizer.finish(c.text) if out.finished else sample.detokenizer.add(new_ids))
            if out.finished:
                d.finish_reason, d.stop_reason = c.finish_reason, c.stop_reason
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
        if not deltas:
            return None
        completions = tuple(
            CompletionOutput(index=self._ids.index(rid), token_ids=tuple(d.token_ids),
                             text="".join(d.text) if self._samples[rid].detokenizer is not None else None,
                             finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                             logprobs=tuple(d.logprobs) if self.params.logprobs is not None else None)
            for rid, d in deltas.items())
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=completions, finished=self._finished, prompt_logprobs=prompt_logprobs,
                             error=self.error, num_cached_tokens=self.num_cached_tokens)


class LoopWaker:
    """Wakes the streams of one event loop that got outputs: one ``call_soon_threadsafe`` per engine step.

    It holds its loop weakly: the wakers are kept in a ``WeakKeyDictionary`` by loop, whose entry a strong reference
    here would keep forever (every ``asyncio.run`` that ever submitted a request would stay in memory)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._ready: list[RequestStream] = []
        self._scheduled = False

    def wake(self, stream: RequestStream) -> None:
        loop = self._loop()
        with self._lock:
            if loop is None or loop.is_closed():    # nobody reads these streams any more (a wake-up it had queued
                self._ready.clear()                 # was dropped with the loop: do not wait for it)
                self._scheduled = False
                return
            self._ready.append(stream)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:        # closed meanwhile
            with self._lock:
                self._ready.clear()
                self._scheduled = False

    def _wake(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._scheduled = False
        for stream in ready:
            stream._event.set()


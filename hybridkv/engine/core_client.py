"""``EngineCoreClient``: the engine in its own process (engine/core.py), served to coroutines of this one.

    engine = EngineCoreClient("path/to/checkpoint", EngineConfig(...))   # starts the engine process, waits
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(out.outputs[0].text, end="")
    engine.shutdown()

What ``hybridkv serve`` runs: the same interface as ``AsyncLLM`` (``submit`` -> ``RequestStream``, ``generate``,
``snapshot``, ``shutdown``, ``dead``), but this process loads no weights and steps no engine, so its HTTP work
never delays a step (they would share the GIL). This process keeps the tokenizer: prompts are encoded, checked
(``EngineLimits``, sent by the engine process when it is ready: a request it cannot serve raises
``RequestError`` here, as ``AsyncLLM`` raises it) and detokenized here. A reader thread takes the engine
process's one message per step and hands each ``RequestStream`` its outputs (one loop wake-up per step per
event loop, as ``AsyncLLM``).

Failures: a start-up failure (a bad checkpoint, out of memory) raises ``EngineStartError`` with the engine
process's reason; once the engine process dies, every live stream ends with an error output, new
submissions raise ``EngineDeadError`` and ``dead`` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hybridkv.engine.async_llm import LoopWaker, QueueFullError, RequestStream
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.core import CORE_COMMAND, CoreJob, LLMFactory
from hybridkv.engine.front import EngineDeadError, EngineSnapshot
from hybridkv.engine.limits import EngineLimits, RequestError, decode_text, takes_skip_special_tokens
from hybridkv.engine.llm import Prompt, parse_prompt, sample_submissions
from hybridkv.engine.request import CompletionOutput, OutputKind, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.envs import child_environment
from hybridkv.models.config import HybridConfig

logger = logging.getLogger("hybridkv.engine")

__all__ = ["EngineChannel", "EngineCoreClient", "EngineStartError", "await_ready", "start_engine_process"]

SOCKET_BUFFER_BYTES = 8 << 20


class EngineStartError(RuntimeError):
    """The engine process could not start (its reason in the message)."""


@dataclass(frozen=True)
class EngineChannel:
    """An API process's channel to an engine process started by someone else (``hybridkv serve
    --api-server-count``), and the limits and step loop's CPU the engine reported on it when it was ready."""

    conn: Connection
    limits: EngineLimits
    engine_cpu: int | None = None


class EngineCoreClient:
    """The engine of ``model`` (a checkpoint directory, or a ``HybridConfig``: random weights, no tokenizer)
    with ``config``, in a process this constructor starts and waits for. ``max_waiting``: as ``AsyncLLM``'s;
    ``factory``: builds the engine process's ``LLM`` from (model, config) instead of ``LLM(model, config=...)``
    (importable by name); ``log_level``: the engine process's ``hybridkv`` log level (None: unconfigured);
    ``engine_cpu``: its step loop's CPU (``engine/affinity.py``; default off; the one it took is ``self.engine_cpu``,
    None if none: this process stays where it runs, ``affinity.keep_off`` moves it off); ``channel``: use this
    channel of an engine process started elsewhere instead of starting one."""

    def __init__(self, model: str | Path | HybridConfig, config: EngineConfig, *, max_waiting: int | None = None,
                 factory: LLMFactory | None = None, log_level: str | None = None, engine_cpu: str | int = "off",
                 channel: EngineChannel | None = None) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive int or None, got {max_waiting!r}")
        self.max_waiting = max_waiting
        # Two locks: a sender may block on a full socket until the engine process reads; the reader thread takes
        # only ``_lock`` (never held across a send), so it always drains the engine's outputs meanwhile, and the
        # engine process, whose step may be sending outputs, always gets to read.
        self._send_lock = threading.Lock()                  # one message at a time on the socket
        self._lock = threading.Lock()                       # owners, counters, calls
        self._owners: dict[str, RequestStream] = {}         # engine request id -> its stream
        self._calls: dict[int, Future] = {}                 # snapshot seq -> its future
        self._seq = itertools.count()
        self._sent = 0                                      # submissions sent
        self._core_waiting = 0                              # the engine process's last num_waiting ...
        self._core_adds = 0                                 # ... and the submissions it had received then
        self._closing: str | None = None
        self._dead: str | None = None
        self._idle = threading.Condition(self._lock)        # notified when the last owned request ends
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
        self.process: subprocess.Popen | None
        if channel is None:
            job = CoreJob(model=model, config=config, factory=factory, log_level=log_level, engine_cpu=engine_cpu)
            self.process, (self._conn,) = start_engine_process(job, channels=1)
        elif factory is not None or log_level is not None or engine_cpu != "off":
            raise ValueError("factory, log_level and engine_cpu belong to whoever starts the engine process, not to "
                             "a channel")
        else:
            self.process, self._conn = None, channel.conn
        try:
            if channel is None:
                self.limits, self.engine_cpu = await_ready(self._conn, self.process)
            else:
                self.limits, self.engine_cpu = channel.limits, channel.engine_cpu
            self.tokenizer = _api_tokenizer(model, config) if self.limits.has_tokenizer else None
            if self.limits.has_tokenizer and self.tokenizer is None:
                raise EngineStartError(f"the engine has a tokenizer, but none was found for {model!s} here")
        except BaseException:
            self._kill()
            self._conn.close()
            raise
        self._decode_skips = takes_skip_special_tokens(self.tokenizer)
        self._reader = threading.Thread(target=self._read, name="hybridkv-core-client", daemon=True)
        self._reader.start()

    # -- what the app reads --------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def dead(self) -> str | None:
        """Why no request can be served any more (None while requests are taken)."""
        return self._closing or self._dead

    def decode(self, ids: Sequence[int], params: SamplingParams) -> str:
        """Text of token ids as a request with ``params`` gets it (as ``LLMEngine.decode``; needs a tokenizer)."""
        assert self.tokenizer is not None
        return decode_text(self.tokenizer, ids, params, takes_skip=self._decode_skips)

    def render_chat(self, messages: Sequence[Any], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: Sequence[Any] | None = None) -> str:
        """One conversation as its prompt text (``LLM.render_chat``)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        from hybridkv.loaders.tokenizer import render_chat

        return render_chat(self.tokenizer, messages, chat_template=chat_template,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           tools=tools, **dict(chat_template_kwargs or {}))

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               stream: bool = True) -> RequestStream:
        """As ``AsyncLLM.submit``: queue ``prompt`` with ``params`` and return its ``RequestStream`` (call it from
        the event loop that reads the stream); raises ``RequestError``, ``QueueFullError`` or
        ``EngineDeadError`` at once."""
        loop = asyncio.get_running_loop()
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        params = SamplingParams() if params is None else params
        parsed = parse_prompt(prompt, self.tokenizer)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        kind = OutputKind.DELTA if stream else OutputKind.FINAL
        submissions = sample_submissions(self.limits.check_request, rid, parsed, params, kind)
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = LoopWaker(loop)
        token_ids = tuple(int(t) for t in submissions[0].token_ids)
        ids = [s.request_id for s in submissions]
        result = RequestStream(self._abort, waker, rid, prompt=parsed.text, prompt_token_ids=token_ids,
                               params=params, sample_ids=ids, stream=stream,
                               decode=self.decode if self.tokenizer is not None else None)
        message = ("add", [(s.request_id, token_ids, s.params, kind.value) for s in submissions])
        with self._send_lock:
            with self._lock:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                waiting = self._core_waiting + self._sent - self._core_adds
                if self.max_waiting is not None and waiting + len(ids) > self.max_waiting:
                    raise QueueFullError(f"{waiting} requests are waiting (max_waiting={self.max_waiting}); "
                                         "retry later")
                for sid in ids:
                    if sid in self._owners:
                        raise RequestError(f"request id {sid!r} is already in use")
                self._sent += len(ids)
                for sid in ids:
                    self._owners[sid] = result
            try:
                self._conn.send(message)
            except OSError as err:
                with self._lock:
                    for sid in ids:
                        self._owners.pop(sid, None)
                raise EngineDeadError(f"the engine process is gone ({err})") from None
        return result

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLM.generate``."""
        result = self.submit(prompt, params, request_id=request_id)
        try:
            async for out in result:
                yield out
        finally:
            result.abort()

    async def snapshot(self) -> EngineSnapshot:
        """What the engine holds and has done (read between two steps in the engine process)."""
        future: Future = Future()
        with self._send_lock:
            with self._lock:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                seq = next(self._seq)
                self._calls[seq] = future
            try:
                self._conn.send(("snapshot", seq))
            except OSError:
                with self._lock:
                    self._calls.pop(seq, None)
                raise EngineDeadError("the engine process is gone") from None
        return await asyncio.wrap_future(future)

    def _abort(self, request_ids: Sequence[str]) -> None:
        with self._send_lock:
            with self._lock:
                for rid in request_ids:
                    self._owners.pop(rid, None)
                if not self._owners:
                    self._idle.notify_all()
                dead = self._dead is not None
            if not dead:
                with contextlib.suppress(OSError):      # (gone: the reader ends every stream)
                    self._conn.send(("abort", list(request_ids)))

    # -- the reader thread --------------------------------------------------------------------------
    def _read(self) -> None:
        conn = self._conn
        failure = None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                self._route(message[1], message[2], message[3])
            elif kind == "state":
                with self._lock:
                    self._core_waiting, self._core_adds = message[1], message[2]
            elif kind == "snapshot":
                with self._lock:
                    future = self._calls.pop(message[1], None)
                if future is not None:
                    result = message[2]
                    if isinstance(result, str):
                        future.set_exception(EngineDeadError(result))
                    else:
                        future.set_result(result)
            elif kind == "dead":
                failure = message[1]
        code = None
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(10)
        reason = self._closing or failure or f"the engine process died (exit code {code})"
        if self._closing is None:
            logger.critical("the engine can serve no more requests: %s", reason)
        self._end(reason)

    def _route(self, packed: list, waiting: int, adds: int) -> None:
        by_stream: dict[RequestStream, list[RequestOutput]] = {}
        with self._lock:
            self._core_waiting, self._core_adds = waiting, adds
            owners = self._owners
            for item in packed:
                if type(item) is tuple:
                    rid, ids, cached = item
                    stream = owners.get(rid)
                    if stream is None:
                        continue                    # aborted
                    out = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=(), finished=False,
                                        outputs=(CompletionOutput(index=0, token_ids=ids, text=None,
                                                                  finish_reason=None),), num_cached_tokens=cached)
                else:
                    stream = owners.get(item.request_id)
                    if stream is None:
                        continue
                    if item.finished:
                        del owners[item.request_id]
                        if not owners:
                            self._idle.notify_all()
                    out = replace(item, prompt=stream.prompt, prompt_token_ids=stream.prompt_token_ids)
                outs = by_stream.get(stream)
                if outs is None:
                    by_stream[stream] = [out]
                else:
                    outs.append(out)
        for stream, outs in by_stream.items():
            stream.deliver(outs)

    def _end(self, reason: str) -> None:
        """Dead: every live stream ends with an error output, every pending snapshot fails."""
        with self._lock:
            self._dead = reason
            owners, self._owners = self._owners, {}
            calls, self._calls = self._calls, {}
            self._idle.notify_all()
        for future in calls.values():
            future.set_exception(EngineDeadError(reason))
        by_stream: dict[RequestStream, list[RequestOutput]] = {}
        for rid, stream in owners.items():
            by_stream.setdefault(stream, []).append(RequestOutput(
                request_id=rid, prompt=stream.prompt, prompt_token_ids=stream.prompt_token_ids, outputs=(),
                finished=True, error=reason))
        for stream, outs in by_stream.items():
            stream.deliver(outs)

    # -- life cycle -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Take no more requests; let the running ones finish for up to ``timeout`` seconds, then abort what is
        left (its streams end with an error); stop the engine process (one this client started: it exits; one
        shared by several API processes: it exits when the last of them closes its channel)."""
        if self._closing is None:
            self._closing = "the server is shutting down"
        self._send_quietly(("drain",))
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("shutdown: requests still running after %.0f s are aborted", timeout)
                self._send_quietly(("close", self._closing))
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._kill()
        else:
            with self._idle:
                if not self._idle.wait_for(lambda: not self._owners, timeout):
                    logger.warning("shutdown: requests still running after %.0f s are aborted", timeout)
            self._send_quietly(("close", self._closing))
            # (the engine sends the aborted requests' outputs, then closes its end: the reader ends there)
        self._reader.join(timeout)
        self._conn.close()

    def _send_quietly(self, message: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send(message)

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def start_engine_process(job: CoreJob, *, channels: int) -> tuple[subprocess.Popen, list[Connection]]:
    """The engine process building ``job``, and this end of its ``channels`` sockets (one per API process; the
    job is sent on the first). Wait for each with ``await_ready``."""
    pairs = [socket.socketpair() for _ in range(channels)]
    for pair in pairs:
        for sock in pair:               # room for a burst of long prompts (capped by the kernel's limits)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    fds = [theirs.fileno() for _, theirs in pairs]
    try:
        process = subprocess.Popen([sys.executable, *CORE_COMMAND, *map(str, fds)], pass_fds=fds,
                                   stdin=subprocess.DEVNULL, env=_core_env())
    except BaseException:
        for pair in pairs:
            for sock in pair:
                sock.close()
        raise
    for _, theirs in pairs:
        theirs.close()
    conns = [Connection(ours.detach()) for ours, _ in pairs]
    with contextlib.suppress(OSError):  # (exited already: await_ready says why)
        conns[0].send(job)
    return process, conns


def await_ready(conn: Connection, process: subprocess.Popen | None) -> tuple[EngineLimits, int | None]:
    """The engine's limits, and the CPU its step loop took (None: not pinned), once it is ready on ``conn``;
    ``EngineStartError`` with its reason if it could not start (``process``: the engine process, when this one
    started it)."""
    while not conn.poll(0.2):
        code = process.poll() if process is not None else None
        if code is not None:
            raise EngineStartError(f"the engine process exited with code {code} before it was ready (its "
                                   f"log above says why)")
    try:
        message = conn.recv()
    except (EOFError, OSError):
        code = process.wait(30) if process is not None else None
        raise EngineStartError(f"the engine process exited with code {code} before it was ready") from None
    if message[0] == "failed":
        raise EngineStartError(f"the engine process could not start: {message[1]}")
    return message[1], message[2]


def _core_env() -> dict[str, str]:
    """The engine process's environment: this one's, with the directory this hybridkv came from on the path."""
    import hybridkv

    return child_environment(path_first=str(Path(hybridkv.__file__).resolve().parent.parent))


def _api_tokenizer(model: str | Path | HybridConfig, config: EngineConfig) -> object | None:
    """The tokenizer ``LLM(model, config=config)`` uses: ``config.tokenizer``, else the checkpoint's."""
    from hybridkv.engine.llm import _resolve_tokenizer
    from hybridkv.loaders.tokenizer import load_tokenizer

    if config.tokenizer is not None:
        return _resolve_tokenizer(config.tokenizer)
    if isinstance(model, HybridConfig):
        return None
    return load_tokenizer(Path(model))

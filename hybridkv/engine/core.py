"""The engine process of ``hybridkv serve``: the model, the KV cache and the step loop, apart from the API process.

Started by ``EngineCoreClient`` (engine/core_client.py) as a fresh interpreter running ``main`` (``CORE_COMMAND``),
never a re-import of the caller's ``__main__``.

In one process, the engine thread's steps would share the GIL with the HTTP work (request parsing, chat
templates, tokenization, writing responses), and every bit of it delays a step. Here the engine runs
``EngineFront.serve`` in its own interpreter; API processes keep HTTP, templates, tokenization and incremental
detokenization, and load no weights. Each API process talks to it over a socket pair of its own (a *channel*:
``multiprocessing.connection``, pickled messages of plain types); ``hybridkv serve --api-server-count N`` runs N
API processes over one engine process:

    API -> engine   a ``CoreJob`` first (on channel 0 only); then ("add", [(id, token ids, params, output kind),
                    ...]), ("abort", [ids]), ("snapshot", seq), ("drain",), ("close", reason)
    engine -> API   ("ready", EngineLimits, the step loop's CPU or None) or ("failed", message) first (on every
                    channel); then one ("out", outputs, waiting, adds) per step with outputs of the channel's
                    requests, ("state", waiting, adds) after aborts, ("snapshot", seq, snapshot or error), ("dead",
                    reason) before exiting on a fatal step error

``waiting`` is ``EngineFront.num_waiting()`` and ``adds`` the submissions the channel had sent when it was read
(each API process bounds its queue with them). A streamed request's output of a step travels as (id, new token
ids, cached prompt tokens); other outputs (final ones, ones with logprobs) whole, without the prompt ids the API
process holds. ``drain``: the channel sends nothing more; once every channel drains, the engine finishes what
runs and exits. ``close`` (or end of file: the API process is gone): the channel's requests are aborted; once
every channel is closed, the engine exits. The process ignores SIGINT and SIGTERM (sent to the whole process group
by Ctrl-C or a supervisor: the API processes handle them and drain the engine).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hybridkv.engine.affinity import check_setting, pin_engine
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import RequestError
from hybridkv.engine.front import EngineDeadError, Submission
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import OutputKind, RequestOutput
from hybridkv.models.config import HybridConfig
from hybridkv.utils import freeze_startup_heap

logger = logging.getLogger("hybridkv.engine")

LLMFactory = Callable[[Any, EngineConfig], LLM]
"""Builds the engine process's ``LLM`` from (model, config); pickled by reference, so importable by name."""


@dataclass(frozen=True, kw_only=True)
class CoreJob:
    """What the engine process builds: ``factory(model, config)`` (default ``LLM(model, config=config)``);
    ``log_level``: the ``hybridkv`` loggers' level there (None: logging left unconfigured); ``engine_cpu``: the
    step loop's CPU, ``auto``, ``off`` or a CPU number (``engine/affinity.py``)."""

    model: str | Path | HybridConfig
    config: EngineConfig
    factory: LLMFactory | None = None
    log_level: str | None = None
    engine_cpu: str | int = "off"

    def __post_init__(self) -> None:
        check_setting(self.engine_cpu)
        if not isinstance(self.model, str | Path | HybridConfig):
            raise TypeError(f"the engine process takes a checkpoint path or a HybridConfig, got "
                            f"{type(self.model).__name__}")
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(self.config).__name__}")

    def build(self) -> LLM:
        if self.factory is None:
            return LLM(self.model, config=self.config)
        return self.factory(self.model, self.config)


def pack_outputs(outputs: Sequence[RequestOutput]) -> list[tuple | RequestOutput]:
    """A step's outputs as sent: a streamed output without logprobs as (id, token ids, cached tokens), others
    without their prompt ids (``unpack`` in the API process puts back what its stream holds)."""
    packed: list[tuple | RequestOutput] = []
    for out in outputs:
        c = out.outputs[0] if out.outputs else None
        if (not out.finished and c is not None and c.logprobs is None and c.text is None and out.metrics is None
                and out.prompt_logprobs is None and out.error is None):
            packed.append((out.request_id, c.token_ids, out.num_cached_tokens))
        else:
            packed.append(replace(out, prompt=None, prompt_token_ids=()))
    return packed


class _Channel:
    """One API process's socket: its reader thread, and the sink of the requests it submitted."""

    def __init__(self, core: EngineCore, index: int, conn: Connection) -> None:
        self.core = core
        self.index = index
        self.conn = conn
        self.adds = 0                      # submissions received (read with num_waiting: the API's queue bound)
        self.draining = False              # sends no more requests
        self.closed = False                # gone, its requests aborted
        self._send_lock = threading.Lock()

    # Sink: the driving thread, the front's lock held; one call per step
    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.send(("out", pack_outputs(outputs), self.core.front.num_waiting(), self.adds))

    def send(self, message: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError):    # (API process gone: its reader closes the channel)
            self.conn.send(message)

    def send_state(self, engine: object) -> None:
        self.send(("state", self.core.front.num_waiting(), self.adds))

    def read(self) -> None:
        front = self.core.front
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self.closed:
                    logger.warning("API process %d is gone: aborting its requests", self.index)
                    self.core.close_channel(self, "the API process is gone")
                return
            kind = message[0]
            if kind == "add":
                subs = [Submission(request_id=rid, token_ids=ids, params=params, output_kind=OutputKind(k))
                        for rid, ids, params, k in message[1]]
                try:
                    front.submit(subs, self)
                except (RequestError, EngineDeadError) as err:
                    self.deliver([RequestOutput(request_id=s.request_id, prompt=None, prompt_token_ids=(),
                                                outputs=(), finished=True, error=str(err)) for s in subs])
                self.adds += len(subs)
            elif kind == "abort":
                front.abort(message[1])
                front.at_step_boundary(self.send_state)         # (after the abort: the inbox is in order)
            elif kind == "snapshot":
                seq = message[1]

                def reply(future: Any, seq: int = seq) -> None:
                    err = future.exception()
                    self.send(("snapshot", seq, future.result() if err is None else f"{type(err).__name__}: {err}"))

                front.snapshot().add_done_callback(reply)
            elif kind == "drain":
                self.core.drain_channel(self)
            elif kind == "close":
                self.core.close_channel(self, message[1])
                with self._send_lock:           # (after the aborted requests' outputs: the API side reads EOF)
                    self.conn.close()
                return
            else:
                logger.error("engine process: unknown message %r", kind)


class EngineCore:
    """The engine process's loop: ``llm``'s front served in this (main) thread, each channel read by a thread of
    its own."""

    def __init__(self, llm: LLM, conns: Sequence[Connection]) -> None:
        self.llm = llm
        self.front = llm.front
        self.channels = [_Channel(self, i, conn) for i, conn in enumerate(conns)]
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def run(self, engine_cpu: str | int = "off") -> int:
        """Report ready on every channel, then serve until every channel drained or closed, or a step failed; the
        exit code. ``engine_cpu``: where this thread, the step loop, runs (``affinity.pin_engine``; the readers,
        started first, keep off its CPU)."""
        for channel in self.channels:
            threading.Thread(target=channel.read, name=f"hybridkv-core-reader-{channel.index}", daemon=True).start()
        device = self.llm.engine.device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        try:
            cpu = pin_engine(engine_cpu, device)
        except ValueError as err:         # (a CPU number this process may not use, or that the OS refused)
            for channel in self.channels:
                channel.send(("failed", str(err)))
            self.llm.shutdown()
            return 1
        for channel in self.channels:     # (an API process that died meanwhile: its reader sees it)
            channel.send(("ready", self.llm.engine.limits, cpu))
        self.front.serve(self._stop)
        dead = self.front.dead
        if dead is not None and not self._stop.is_set():      # a fatal step error (its outputs are sent)
            for channel in self.channels:
                channel.send(("dead", dead))
        self.llm.shutdown()
        return 0

    def drain_channel(self, channel: _Channel) -> None:
        with self._lock:
            channel.draining = True
            self._stop_when_done()

    def close_channel(self, channel: _Channel, reason: str) -> None:
        with self._lock:
            channel.closed = channel.draining = True
            last = all(c.closed for c in self.channels)
        if last:
            self.front.close(reason)        # (every request aborted, with an error output naming the reason)
        else:
            self.front.abort(self.front.requests_of(channel))
        with self._lock:
            self._stop_when_done()

    def _stop_when_done(self) -> None:
        """(lock held) Stop once no channel can send requests any more."""
        if all(c.draining for c in self.channels):
            self._stop.set()
            self.front.wake()


def main(argv: Sequence[str]) -> int:
    """The engine process: read the ``CoreJob`` from the first of the sockets whose descriptors ``argv`` holds
    (one per API process), build it, report ready (its ``EngineLimits``) or why it failed on each, then serve."""
    # Ctrl-C and a supervisor's SIGTERM to the whole group reach this process too: the API processes handle them
    # (they drain, then tell this one to stop); this one stops by itself only when every API process is gone.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conns = [Connection(int(fd)) for fd in argv]
    job: CoreJob = conns[0].recv()
    if job.log_level is not None:
        from hybridkv.commands import configure_logging

        configure_logging(job.log_level)
    try:
        llm = job.build()
    except BaseException as err:        # (a bad checkpoint, out of memory, a failed import, ...)
        logger.debug("the engine could not start", exc_info=err)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(("failed", f"{type(err).__name__}: {err}"))
        return 1
    logger.debug("engine process: %d start-up objects set aside from the collector", freeze_startup_heap())
    return EngineCore(llm, conns).run(job.engine_cpu)


CORE_COMMAND: tuple[str, ...] = (
    "-c", "import sys; from hybridkv.engine.core import main; sys.exit(main(sys.argv[1:]))")
"""``python <CORE_COMMAND...> <socket fd> [<socket fd> ...]`` starts the engine process (one socket per API
process)."""

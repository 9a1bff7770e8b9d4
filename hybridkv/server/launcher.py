"""``hybridkv serve --api-server-count N`` (N > 1): N API processes over one engine process, on one port.

    launcher (this process)   binds the port, starts the engine process with a channel per API process, waits
                              until it is ready (a start-up failure is the CLI's one-line error), starts the
                              API processes off the step loop's CPU, waits; on SIGTERM / Ctrl-C they all drain,
                              then it exits
    engine process            ``engine/core.py``: the model, the KV cache and the step loop (on a CPU of its own:
                              ``--engine-cpu``, ``engine/affinity.py``); exits once the last API process closes
                              its channel
    API process i             uvicorn and the app over an ``EngineCoreClient`` on channel i, accepting on the
                              shared listening socket (whichever process is free takes the next connection)

Why: one API process's event loop (request parsing, chat templates, tokenization, detokenization, one write per
streamed chunk) tops out below what one GPU's engine produces for a ~1B model; the engine step loop never shares
a GIL with it either way. Request metrics are added up across the API processes (prometheus-client's
multiprocess mode, in a directory the launcher creates and removes); API process 0 alone logs the stats line.
If an API process dies, the launcher stops the others and exits 1: a supervisor restarts the whole server.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from hybridkv.engine.affinity import keep_off
from hybridkv.engine.config import EngineConfig
from hybridkv.envs import child_environment

logger = logging.getLogger("hybridkv.server")

API_COMMAND: tuple[str, ...] = (
    "-c", "import sys; from hybridkv.server.launcher import api_main; sys.exit(api_main(sys.argv[1:]))")
"""``python <API_COMMAND...> <index> <listening socket fd> <engine channel fd> <launcher socket fd>`` starts an
API process; it reads (args, config, the engine's limits, its step loop's CPU) from the launcher socket, whose end of
file later tells it to stop."""

LISTEN_BACKLOG = 4096


def serve_processes(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the server as ``args.api_server_count`` API processes over one engine process; the exit code."""
    from hybridkv.engine.core import CoreJob
    from hybridkv.engine.core_client import await_ready, start_engine_process

    count = args.api_server_count
    listener = socket.create_server((args.host, args.port), backlog=LISTEN_BACKLOG,
                                    family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    metrics_dir = tempfile.mkdtemp(prefix="hybridkv-metrics-")
    engine, channels = start_engine_process(CoreJob(model=args.model, config=config, log_level=args.log_level,
                                                    engine_cpu=args.engine_cpu), channels=count)
    env = child_environment(path_first=_package_root(), metrics_dir=metrics_dir)
    workers: list[subprocess.Popen] = []
    controls: list[Connection] = []
    try:
        ready = [await_ready(channel, engine) for channel in channels]     # (EngineStartError: why it cannot)
        keep_off(ready[0][1])           # (this process and the API processes it starts: off the step loop's CPU)
        for index, channel in enumerate(channels):
            ours, theirs = socket.socketpair()
            fds = (listener.fileno(), channel.fileno(), theirs.fileno())
            workers.append(subprocess.Popen([sys.executable, *API_COMMAND, str(index), *map(str, fds)],
                                            pass_fds=fds, stdin=subprocess.DEVNULL, env=env))
            theirs.close()
            channel.close()
            control = Connection(ours.detach())
            control.send((args, config, *ready[index]))
            controls.append(control)
        port = listener.getsockname()[1]
        listener.close()
        logger.info("%d API processes on http://%s:%d over one engine process", count, args.host, port)
        return _supervise(workers, args.shutdown_timeout)
    finally:
        for control in controls:
            control.close()             # (an API process still running stops at this end of file)
        for worker in workers:
            _reap(worker, args.shutdown_timeout + 30.0)
        for channel in channels:
            channel.close()
        _reap(engine, 30.0)             # (exits once the last API process closed its channel)
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(workers: Sequence[subprocess.Popen], shutdown_timeout: float) -> int:
    """Wait for a signal or for an API process to exit; then stop the others and wait for all; the exit code."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = False
        while not stop.wait(0.2):
            gone = [(i, w.returncode) for i, w in enumerate(workers) if w.poll() is not None]
            if gone:
                failed = True
                for i, code in gone:
                    logger.error("API process %d exited (code %s): stopping the server", i, code)
                break
        for worker in workers:              # (Ctrl-C reached them already; a supervisor's SIGTERM may not have)
            if worker.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + shutdown_timeout + 30.0
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(max(deadline - time.monotonic(), 0.0))
        failed = failed or any(w.returncode not in (0, None) for w in workers)
        logger.info("stopped")
        return 1 if failed else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def api_main(argv: Sequence[str]) -> int:
    """An API process (``API_COMMAND``): the app over channel ``argv[2]`` of the engine process, served on the
    listening socket ``argv[1]`` until SIGTERM, Ctrl-C or the launcher's end of file."""
    from hybridkv.commands import configure_logging
    from hybridkv.engine.core_client import EngineChannel, EngineCoreClient
    from hybridkv.server.cli import serve_app

    index, listen_fd, channel_fd, control_fd = map(int, argv)
    control = Connection(control_fd)
    args, config, limits, engine_cpu = control.recv()
    configure_logging(args.log_level)
    listener = socket.socket(fileno=listen_fd)
    engine = EngineCoreClient(args.model, config, max_waiting=args.max_waiting,
                              channel=EngineChannel(Connection(channel_fd), limits, engine_cpu))
    threading.Thread(target=_stop_with_launcher, args=(control,), name="hybridkv-launcher-watch",
                     daemon=True).start()
    return serve_app(args, engine, [listener], stats=index == 0)


def _stop_with_launcher(control: Connection) -> None:
    """SIGTERM this process (uvicorn then drains) once the launcher is gone."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            control.recv()
    os.kill(os.getpid(), signal.SIGTERM)


def _reap(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not stop in %.0f s: killed", process.pid, timeout)
        process.kill()
        process.wait(30)


def _package_root() -> str:
    import hybridkv

    return str(Path(hybridkv.__file__).resolve().parent.parent)


__all__ = ["API_COMMAND", "api_main", "serve_processes"]

"""``hybridkv serve MODEL``: the OpenAI-compatible server, registered into the ``hybridkv`` command on import.

Starts the engine process (``EngineCoreClient``: the model, the KV cache and the step loop, built as ``LLM``
with an ``EngineConfig`` from the options, in a process of its own so that HTTP work never delays a step) and
serves the app (``server/app.py``) with uvicorn on ``--host`` (127.0.0.1 unless told otherwise) and
``--port``. Logging goes to stderr at ``--log-level`` (info: the KV plan, the backend, CUDA graphs, one
stats line every ``--stats-interval`` seconds while requests run). SIGTERM or Ctrl-C: no new connections,
running requests finish (at most ``--shutdown-timeout`` seconds, then they are aborted), the engine process
and any tensor-parallel ranks stop, exit code 0. If the engine process dies, requests get 503 and
``/health`` fails. Importing this module imports none of the server's
dependencies (``pip install 'hybridkv[server]'``).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
from typing import Any

from hybridkv.commands import LOG_LEVELS, Command, UsageError, configure_logging, device_arg, positive_int, register
from hybridkv.utils import freeze_startup_heap

logger = logging.getLogger("hybridkv.server")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number in 1..65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def engine_cpu_arg(text: str) -> str | int:
    """``--engine-cpu``: auto, off or a CPU number this process may use (a usage error otherwise)."""
    from hybridkv.engine.affinity import allowed_cpus, choose_engine_cpu

    if text in ("auto", "off"):
        return text
    if not (text.isascii() and text.isdecimal()):
        raise argparse.ArgumentTypeError(f"expected auto, off or a CPU number, got {text!r}")
    try:            # (the engine process checks it again; here it is a usage error before any start-up)
        choose_engine_cpu(int(text), allowed=allowed_cpus(), cuda=False)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return int(text)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridkv.engine.affinity import MIN_CPUS_TO_PIN

    parser.add_argument("model", metavar="MODEL", help="checkpoint directory (HF or hybridkv)")
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    http.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but "
                      "/health, /metrics, /version)")
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="the model name(s) requests may use (default: MODEL as given)")
    http.add_argument("--max-waiting", type=positive_int, default=None,
                      help="requests that may wait to be scheduled; beyond it a request gets 429 with Retry-After "
                      "(default: no bound)")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default info")
    http.add_argument("--stats-interval", type=_seconds, default=10.0,
                      help="seconds between stats log lines while requests run (0: none; default 10)")
    http.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                      help="on SIGTERM, seconds running requests get to finish before they are aborted (default 30)")
    http.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    http.add_argument("--api-server-count", type=positive_int, default=1,
                      help="API processes (HTTP, chat templates, tokenization, streaming) over the one engine "
                      "process, sharing the port; more than one when one process's event loop cannot keep up "
                      "with the engine (default 1)")
    http.add_argument("--engine-cpu", type=engine_cpu_arg, default="auto",
                      help="the CPU the engine's step loop runs on alone (the server's other threads and processes "
                      f"keep off it): auto (on a GPU with {MIN_CPUS_TO_PIN} or more CPUs: the highest-numbered CPU "
                      "of the GPU's NUMA node; default), off, or a CPU number")
    model = parser.add_argument_group("engine")
    model.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    model.add_argument("--dtype", default="auto", help="auto (checkpoint dtype on CUDA, float32 on the CPU), "
                       "bfloat16, float16, float32")
    model.add_argument("--device", type=device_arg, default="auto",
                       help="cpu, cuda, cuda:N, or auto (CUDA when available; default)")
    model.add_argument("--backend", default="auto", help="kernel backend: auto, torch, triton, ... (default auto)")
    model.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    model.add_argument("--max-model-len", type=positive_int, default=None,
                       help="tokens per request, prompt and output (default: the model's max positions)")
    model.add_argument("--kv-memory", default=None,
                       help="KV-cache budget, e.g. 4GiB (default: 80%% of free GPU memory, or a share of RAM)")
    model.add_argument("--host-cache-memory", default="0",
                       help="host memory for more prefix-cache checkpoints of recurrent (Mamba, DeltaNet) states, "
                            "e.g. 32GiB (default 0: none)")
    model.add_argument("--max-num-seqs", type=positive_int, default=256, help="concurrent requests (default 256)")
    model.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="tokens per step")
    model.add_argument("--prefill-spread", type=positive_int, default=None,
                       help="while requests decode, a step computes at most the pending prompt tokens / this "
                            "(at least --prefill-floor, rounded up to the step's CUDA-graph bucket): bursts of "
                            "prompts spread over steps (default: the engine's, 8; 1: off)")
    model.add_argument("--prefill-floor", type=positive_int, default=None,
                       help="the lowest a spread step's prompt-token cap goes: max(this, pending / --prefill-spread) "
                            "(default: the engine's, 192)")
    model.add_argument("--no-prefix-caching", action="store_true")
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    model.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> Any:
    from hybridkv.engine.config import EngineConfig

    return EngineConfig(dtype=args.dtype, device=args.device, backend=args.backend, tokenizer=args.tokenizer,
                        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_memory, host_cache_memory=args.host_cache_memory,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        **{name: getattr(args, name) for name in ("prefill_spread", "prefill_floor")
                           if getattr(args, name) is not None},
                        enable_prefix_caching=not args.no_prefix_caching,
                        cuda_graphs=False if args.enforce_eager else None, seed=args.seed)


def run_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        import uvicorn  # noqa: F401

        import hybridkv.server.app  # noqa: F401
    except ImportError as err:
        raise UsageError(f"hybridkv serve: needs {err.name} (pip install 'hybridkv[server]')") from None
    from hybridkv import __version__

    config = engine_config(args)
    logger.info("hybridkv %s: serving %s (%s)", __version__, args.model, config)
    if args.api_server_count > 1:
        from hybridkv.server.launcher import serve_processes

        return serve_processes(args, config)
    from hybridkv.engine.affinity import keep_off
    from hybridkv.engine.core_client import EngineCoreClient

    engine = EngineCoreClient(args.model, config, max_waiting=args.max_waiting, log_level=args.log_level,
                              engine_cpu=args.engine_cpu)
    keep_off(engine.engine_cpu)         # (this process: off the step loop's CPU)
    return serve_app(args, engine)


def event_loop_impls() -> tuple[str, str]:
    """uvicorn's event loop and HTTP implementation: uvloop and httptools where they import (``hybridkv[server]``
    installs both: a streamed chunk costs a busy API process's event loop less time than with asyncio's loop and
    h11, so its streams' chunks wait less behind each other), else asyncio and h11 (as uvicorn's "auto", named here
    so that the log says which)."""
    import importlib

    def imports(name: str) -> bool:
        try:
            importlib.import_module(name)
        except ImportError:         # (not installed, or a broken build: uvicorn would fail on it)
            return False
        return True

    return ("uvloop" if imports("uvloop") else "asyncio"), ("httptools" if imports("httptools") else "h11")


def serve_app(args: argparse.Namespace, engine: Any, sockets: list[Any] | None = None, *,
              stats: bool = True) -> int:
    """Serve the app over ``engine`` (an ``EngineCoreClient``, shut down on the way out) with uvicorn on
    ``--host``/``--port``, or on ``sockets`` (listening already); ``stats``: this process logs the stats line."""
    import uvicorn

    from hybridkv.server.app import ServerSettings, build_app

    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = logging.getLogger("hybridkv").handlers
        logging.getLogger(name).propagate = False
    settings = ServerSettings(served_model_names=tuple(args.served_model_name or [args.model]),
                              model_root=str(args.model), api_key=args.api_key,
                              stats_interval=args.stats_interval if stats else 0.0)
    loop, http = event_loop_impls()
    (logger.info if stats else logger.debug)("HTTP: uvicorn with the %s event loop and the %s parser", loop, http)
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine, settings), host=args.host, port=args.port, log_config=None, log_level=args.log_level,
        access_log=not args.disable_access_log, timeout_graceful_shutdown=math.ceil(args.shutdown_timeout),
        lifespan="on", loop=loop, http=http))

    def on_terminate(signum: int, frame: object) -> None:
        # uvicorn handles SIGTERM while it runs and raises it again once it has shut down; this handler then
        # makes that a normal exit (and covers a signal between here and uvicorn taking over).
        server.should_exit = True

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:         # (this process serves: its start-up heap stays out of the collector's passes)
        logger.debug("API process: %d start-up objects set aside from the collector", freeze_startup_heap())
    previous = signal.signal(signal.SIGTERM, on_terminate) if main_thread else None
    try:
        server.run(sockets=sockets)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        engine.shutdown(timeout=args.shutdown_timeout)
        logger.info("stopped")
    return 0 if server.started else 1


register(Command(name="serve", help="serve a checkpoint over HTTP with the OpenAI API (completions, chat, "
                 "streaming, metrics)", add_arguments=_serve_arguments, run=run_serve))

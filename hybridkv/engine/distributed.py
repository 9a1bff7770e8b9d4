"""Tensor-parallel processes: starting the ranks, their process groups, and the control channel.

Process model. Rank 0 is the user's process: it runs the scheduler, the sampler and its own model shard.
Ranks 1..N-1 only run their shard. They are either spawned here or started by ``torchrun`` (detected from
``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``): either way every rank goes through the same ``LLM(...)``
construction, and ranks > 0 then serve steps until rank 0 shuts down.

Spawned ranks are fresh interpreters running ``python -m hybridkv.engine.worker`` (``WORKER_COMMAND``), never
a re-import of the caller's ``__main__``: rank 0 may be a notebook, ``python -c``, a script read from stdin
or one without a ``__main__`` guard. What they run (a picklable function and its arguments, e.g. a checkpoint
path or a config, or an in-memory model's full weights) travels in a job file that each rank maps
(``torch.load(mmap=True)``), with rank 0's store address; each rank's number comes on its command line. Nothing
travels in the environment.
A rank that fails before it joins writes its error next to the job file, so rank 0's error says why.

Three process groups:

- the default group: the rendezvous only (its TCP store lives in rank 0);
- ``device``: the collectives inside the forward (all-reduce, logits gather): NCCL on CUDA, gloo on the
  CPU. On gloo its timeout is the user's ``timeout``: a collective with a dead or stuck peer raises. NCCL
  collectives do not block the host, so rank 0 bounds each step itself (``wait_for``: the step's completion
  event, polled with the other ranks' liveness, until ``timeout``) and then aborts the NCCL communicators;
  the NCCL group's own timeout is ``timeout + NCCL_BACKSTOP_S``, a backstop whose watchdog tears the
  process down only if that bounded wait could not run (e.g. a host sync inside the forward);
- ``control``: gloo (host data, also on CUDA): rank 0 broadcasts each step's host batch (a packed int64
  tensor, see ``pack_step``). Its group timeout is long, because ranks > 0 wait on it while the user is
  idle; rank 0 bounds every send by ``timeout`` itself (``Work.wait(timeout)``). A rank that died closes its
  sockets, which fails the next collective at once; a spawned rank's death is also seen before each send.

Spawned ranks also exit when rank 0 disappears (a watcher thread on the parent pid), whatever they are
waiting on.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import os
import shutil
import site
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

import hybridkv
from hybridkv import envs
from hybridkv.layers.parallel import TensorParallel

logger = logging.getLogger("hybridkv.distributed")

_IDLE_TIMEOUT = datetime.timedelta(days=365)      # how long a rank > 0 may wait for the next step
NCCL_BACKSTOP_S = 60.0                            # NCCL group timeout = distributed timeout + this
_POLL_CHECK_S = 0.02                              # how often wait_for looks at the other ranks
STARTUP_S = 120.0           # spawned ranks may take this long to join, at least (fresh interpreters import torch)
_T = TypeVar("_T")

# Step message: header (int64) = [op, num_tokens, num_reqs, num_outputs, num_copies, width per group...],
# then one int64 payload: input_ids | query_lens | seq_lens | logits_indices | copy src | copy dst | tables.
OP_EXECUTE, OP_SHUTDOWN = 1, 2
_FIXED = 5


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died or timed out; the engine cannot continue."""


@dataclass(frozen=True)
class SpawnedRank:
    """Where a rank that ``spawn_group`` started stands: its rank of ``size``, and rank 0's TCP store."""

    rank: int
    size: int
    host: str
    port: int


# Set (by the worker entry, for the duration of its job) in a rank that spawn_group started.
_SPAWNED_RANK: contextvars.ContextVar[SpawnedRank | None] = contextvars.ContextVar("hybridkv_spawned_rank",
                                                                                   default=None)


@contextlib.contextmanager
def as_spawned_rank(spawned: SpawnedRank) -> Iterator[None]:
    """Within this block, ``LLM(..., tensor_parallel_size=N)`` joins the group as ``spawned`` says."""
    token = _SPAWNED_RANK.set(spawned)
    try:
        yield
    finally:
        _SPAWNED_RANK.reset(token)


def torchrun_world() -> tuple[int, int, int] | None:
    """(world size, rank, local rank) when this process is a launched rank: one ``spawn_group`` started, or one
    started by torchrun (read from its environment); None otherwise."""
    spawned = _SPAWNED_RANK.get()
    if spawned is not None:
        return spawned.size, spawned.rank, spawned.rank
    return envs.torchrun_world()


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank ``local_rank``'s device on this host: ``cuda:{local_rank}``, or the CPU."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on 'cuda' or 'cpu' devices, got {device}")
    if device.index not in (None, local_rank):
        raise ValueError(f"tensor parallelism places rank r on cuda:r; pass device='cuda', not {device}")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"tensor-parallel local rank {local_rank} needs cuda:{local_rank}, but this host has "
                         f"{count} GPU(s)")
    return torch.device("cuda", local_rank)


@dataclass(eq=False)
class ParallelContext:
    """This process's rank, its groups, and (on rank 0 when it spawned them) the other ranks' processes."""

    rank: int
    size: int
    device: torch.device
    tp: TensorParallel
    control: Any
    timeout: float
    processes: list[Any] = field(default_factory=list)
    closed: bool = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- startup -----------------------------------------------------------------------------------------
    def run_everywhere(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on every rank and agree on the outcome: if any rank raised, rank 0 raises an error
        naming the rank and its exception, and the other ranks exit. (Without this, rank 0 would wait for a
        failed rank in the next collective until the timeout.)"""
        error: str | None = None
        mine: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as err:                        # reported to the others below
            error, mine = f"{type(err).__name__}: {err}", err
            if not self.is_driver:
                traceback.print_exc()
        errors: list[Any] = [None] * self.size
        dist.all_gather_object(errors, error, group=self.control)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        self.close(graceful=False)
        if not self.is_driver:
            raise SystemExit(1)
        if mine is not None:
            raise mine                                  # the same error every rank hit (e.g. a bad config)
        rank, message = failed[0]
        raise TensorParallelError(f"tensor-parallel rank {rank} failed while {what}: {message}")

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks (e.g. each GPU's free memory, so every rank plans the same)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def share(self, obj: _T | None) -> _T:
        """Rank 0's ``obj`` on every rank (startup data such as the KV-cache plan)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    # -- steps ---------------------------------------------------------------------------------------------
    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        """Rank 0: poll ``done`` (e.g. the step's CUDA event) until it is true, raising
        ``TensorParallelError`` as soon as a spawned rank has exited or once ``timeout`` has passed. NCCL
        collectives never block the host, so this is where a rank that dies or stalls mid-forward is seen
        (a blocking ``synchronize`` would wait for the NCCL watchdog instead). Spins for the first few
        milliseconds (decode steps are short), then sleeps 0.2 ms between polls."""
        start = time.monotonic()
        next_check = start
        while not done():
            now = time.monotonic()
            if now >= next_check:
                self.check_alive()
                next_check = now + _POLL_CHECK_S
            if now - start > self.timeout:
                raise TensorParallelError(f"{what} did not finish within distributed_timeout={self.timeout:g}s "
                                          f"(a rank is stuck, or died unseen)")
            time.sleep(0 if now - start < 0.005 else 2e-4)

    def await_exits(self, seconds: float) -> None:
        """Wait up to ``seconds`` in all for spawned ranks to exit (after a failure, so their exit codes show)."""
        deadline = time.monotonic() + seconds
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def check_alive(self) -> None:
        """Raise if a rank this process spawned has exited."""
        for rank, proc in enumerate(self.processes, start=1):
            if proc.exitcode is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                          f"{proc.exitcode}")

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        """Rank 0: broadcast one message, waiting at most ``timeout`` for the other ranks to take it."""
        works = [dist.broadcast(header, src=0, group=self.control, async_op=True)]
        if payload.numel():
            works.append(dist.broadcast(payload, src=0, group=self.control, async_op=True))
        for work in works:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))

    def receive(self, header_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ranks > 0: the next message (waits as long as rank 0 is idle)."""
        header = torch.empty(header_len, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        size = payload_size(header)
        payload = torch.empty(size, dtype=torch.int64)
        if size:
            dist.broadcast(payload, src=0, group=self.control)
        return header, payload

    # -- shutdown ------------------------------------------------------------------------------------------
    def close(self, *, graceful: bool = True, header_len: int | None = None) -> None:
        """Leave the groups. Rank 0 first tells the other ranks to stop (``graceful``, when ``header_len``
        is known), then waits briefly for spawned ranks and terminates any that linger."""
        if self.closed:
            return
        self.closed = True
        if self.is_driver and graceful and header_len is not None:
            with contextlib.suppress(Exception):
                self.check_alive()
                header = torch.zeros(header_len, dtype=torch.int64)
                header[0] = OP_SHUTDOWN
                self.send(header, header[:0])
        if not graceful and self.device.type == "cuda":
            # Abort the NCCL communicators first: kernels still waiting on a dead or stuck peer return, so
            # this process's stream drains and the watchdog has no pending collective left to time out.
            _bounded(self.tp.group.abort, 10.0, "aborting the NCCL communicators", self.device)
        for proc in self.processes:
            if graceful:
                proc.join(timeout=5)
            if proc.exitcode is None:        # failed group, or a rank that did not stop: it goes now
                proc.kill()
                proc.join(timeout=5)
        # The spawned ranks are gone, so pending collectives fail at once and the groups can be destroyed
        # (which also lets this process start another group later). Bounded: a backend that still waits on
        # a lost peer must not turn an error into a hang.
        _bounded(dist.destroy_process_group, 30.0, "destroying the process groups", self.device)


def _bounded(fn: Callable[[], object], timeout: float, what: str, device: torch.device) -> None:
    """Run ``fn`` in a daemon thread (on this rank's ``device``), waiting at most ``timeout`` seconds; its errors
    are ignored. For teardown: a backend that still waits on a lost peer (or a faulted device) must not turn an
    error into a hang."""

    def run() -> None:
        with contextlib.suppress(Exception):
            if device.type == "cuda":
                torch.cuda.set_device(device)
            fn()

    thread = threading.Thread(target=run, daemon=True, name="hybridkv-tp-teardown")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("tensor parallelism: %s did not finish within %gs; continuing without it", what, timeout)


def payload_size(header: torch.Tensor) -> int:
    """Length of the payload that follows ``header``."""
    if int(header[0]) != OP_EXECUTE:
        return 0
    num_tokens, num_reqs, num_outputs, num_copies = (int(v) for v in header[1:_FIXED])
    widths = header[_FIXED:]
    return num_tokens + 2 * num_reqs + num_outputs + 2 * num_copies + num_reqs * int(widths.sum())


def pack_step(input_ids: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
              block_tables: Sequence[np.ndarray], logits_indices: np.ndarray,
              copies: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's host batch (and pending Mamba state copies) as (header, payload) int64 tensors."""
    pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
    header = np.array([OP_EXECUTE, len(input_ids), len(query_lens), len(logits_indices), len(pairs),
                       *(t.shape[1] for t in block_tables)], dtype=np.int64)
    payload = np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in (
        input_ids, query_lens, seq_lens, logits_indices, pairs[:, 0], pairs[:, 1], *block_tables)])
    return torch.from_numpy(header), torch.from_numpy(payload)


def unpack_step(header: torch.Tensor, payload: torch.Tensor) -> dict[str, Any]:
    """Inverse of ``pack_step``: the StepBatch fields and the copy pairs."""
    h = header.numpy()
    num_tokens, num_reqs, num_outputs, num_copies = (int(v) for v in h[1:_FIXED])
    data = payload.numpy()
    out: dict[str, Any] = {}
    offset = 0
    for name, n in (("input_ids", num_tokens), ("query_lens", num_reqs), ("seq_lens", num_reqs),
                    ("logits_indices", num_outputs), ("src", num_copies), ("dst", num_copies)):
        out[name] = data[offset:offset + n]
        offset += n
    tables = []
    for width in h[_FIXED:].tolist():
        tables.append(data[offset:offset + num_reqs * width].reshape(num_reqs, width).astype(np.int32))
        offset += num_reqs * width
    out["block_tables"] = tables
    out["copies"] = list(zip(out.pop("src").tolist(), out.pop("dst").tolist(), strict=True))
    return out


def header_length(num_groups: int) -> int:
    return _FIXED + num_groups


# -- starting the ranks ----------------------------------------------------------------------------------------
def _groups(rank: int, size: int, device: torch.device, timeout: float) -> tuple[TensorParallel, Any]:
    """The device and control groups (collective calls: every rank creates them in the same order)."""
    nccl = device.type == "cuda"
    device_group = dist.new_group(backend="nccl" if nccl else "gloo",
                                  timeout=datetime.timedelta(seconds=timeout + (NCCL_BACKSTOP_S if nccl else 0)))
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank=rank, size=size, group=device_group), control


def _init_default(store: Any, rank: int, size: int, device: torch.device, timeout: float) -> None:
    """The default group over ``store`` (None: torchrun's ``env://`` rendezvous)."""
    if dist.is_initialized():
        raise TensorParallelError("a tensor-parallel LLM is already running in this process (torch.distributed "
                                  "is initialised); shut it down first (LLM.shutdown())")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)


def join_group(size: int, device: torch.device, timeout: float) -> ParallelContext:
    """A rank started by torchrun (or spawned by ``spawn_group``): join the group the environment names."""
    world = torchrun_world()
    assert world is not None
    world_size, rank, local_rank = world
    if world_size != size:
        raise ValueError(f"tensor_parallel_size={size}, but the launcher started WORLD_SIZE={world_size} "
                         f"processes; they must match")
    device = rank_device(device, local_rank)
    store = None
    spawned = _SPAWNED_RANK.get()
    if spawned is not None:                     # rank 0's store (torchrun's ranks use env:// instead)
        store = dist.TCPStore(spawned.host, spawned.port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        store.set(_joined_key(rank), "1")      # rank 0 waits for these before its own rendezvous
    _init_default(store, rank, size, device, timeout)
    tp, control = _groups(rank, size, device, timeout)
    return ParallelContext(rank=rank, size=size, device=device, tp=tp, control=control, timeout=timeout)


# How spawn_group starts a rank: ``python <WORKER_COMMAND...> <job file> <rank>``. Tests point it at a wrapper
# of the worker entry (e.g. one that makes a rank fail inside a step).
WORKER_COMMAND: tuple[str, ...] = ("-m", "hybridkv.engine.worker")
JOB_FILE = "job.json"
PAYLOAD_FILE = "payload.pt"


def error_file(job_file: Path, rank: int) -> Path:
    """Where spawned rank ``rank`` writes the error it failed with before joining the group."""
    return job_file.with_name(f"rank{rank}.error")


class RankProcess:
    """A spawned rank's process (``subprocess.Popen``) with the ``multiprocessing.Process`` interface the group
    uses: ``pid``, ``exitcode`` (None while it runs; -N when killed by signal N), ``join``, ``kill``."""

    def __init__(self, popen: subprocess.Popen, rank: int) -> None:
        self._popen = popen
        self.rank = rank

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()


def _worker_env(threads: int) -> dict[str, str]:
    """The spawned ranks' environment: this process's, with its thread count, and with the directory this
    hybridkv was imported from on the path (a notebook may have found it through ``sys.path`` alone)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    root = str(Path(hybridkv.__file__).resolve().parent.parent)
    site_dirs = {str(Path(p).resolve()) for p in [*getattr(site, "getsitepackages", list)(),
                                                   site.getusersitepackages()]}
    if root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _write_job(directory: Path, size: int, port: int, threads: int, worker: Callable[..., None],
               worker_args: tuple[Any, ...]) -> Path:
    """The job file every spawned rank reads: the rendezvous as JSON, ``worker(*worker_args)`` pickled with
    ``torch.save`` beside it (tensors stored once, mapped by each rank)."""
    torch.save((worker, worker_args), directory / PAYLOAD_FILE)
    job = directory / JOB_FILE
    job.write_text(json.dumps({"size": size, "host": "127.0.0.1", "port": port, "threads": threads,
                               "payload": PAYLOAD_FILE}))
    return job


def _why_dead(processes: Sequence[RankProcess], job: Path) -> list[str]:
    """'rank r exited with code c: <its error>' for every spawned rank that has exited."""
    out = []
    for proc in processes:
        if proc.exitcode is None:
            continue
        reason = ""
        with contextlib.suppress(OSError):
            reason = error_file(job, proc.rank).read_text().strip()
        out.append(f"rank {proc.rank} exited with code {proc.exitcode}" + (f": {reason}" if reason else ""))
    return out


def spawn_group(size: int, device: torch.device, timeout: float, worker: Callable[..., None],
                worker_args: tuple[Any, ...]) -> ParallelContext:
    """Rank 0 of a group it spawns: start ranks 1..size-1 as fresh interpreters (``WORKER_COMMAND``) that run
    ``worker(*worker_args)`` as spawned ranks (``as_spawned_rank``, which ``join_group`` reads), then
    rendezvous with them (the TCP store is rank 0's, on a free port the OS picks, so there is no port race).
    ``worker`` must be importable by name (pickled by reference); ``worker_args`` picklable."""
    device = rank_device(device, 0)
    if device.type == "cuda" and size > torch.cuda.device_count():   # fail before spawning anything
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, this host has "
                         f"{torch.cuda.device_count()}")
    if not sys.executable:
        raise TensorParallelError("cannot spawn tensor-parallel ranks: sys.executable is unknown (an embedded "
                                  "interpreter?); launch the ranks with torchrun instead")
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    threads = max(1, (os.cpu_count() or 1) // size) if device.type == "cpu" else 1
    directory = Path(tempfile.mkdtemp(prefix="hybridkv-tp-"))
    processes: list[RankProcess] = []
    try:
        job = _write_job(directory, size, store.port, threads, worker, worker_args)
        env = _worker_env(threads)
        for rank in range(1, size):
            popen = subprocess.Popen([sys.executable, *WORKER_COMMAND, str(job), str(rank)], env=env,
                                     stdin=subprocess.DEVNULL)
            processes.append(RankProcess(popen, rank))
        try:
            _await_spawned(store, processes, job, max(timeout, STARTUP_S))
            _init_default(store, 0, size, device, timeout)
            tp, control = _groups(0, size, device, timeout)
        except Exception as err:
            dead = _why_dead(processes, job)              # before the others are killed
            for proc in processes:
                proc.kill()
                proc.join(timeout=5)
            raise TensorParallelError(f"tensor-parallel rendezvous failed ({'; '.join(dead) or err})") from err
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    finally:
        # Every rank has mapped the payload once it joined (or is gone): the files can go.
        shutil.rmtree(directory, ignore_errors=True)
    return ParallelContext(rank=0, size=size, device=device, tp=tp, control=control, timeout=timeout,
                           processes=processes)


def _joined_key(rank: int) -> str:
    return f"hybridkv/joined/{rank}"


def _await_spawned(store: Any, processes: Sequence[RankProcess], job: Path, timeout: float) -> None:
    """Wait until every spawned rank has reached the store, failing at once if one exits first (a rank that
    cannot even start, e.g. a broken import, would otherwise keep the rendezvous waiting for ``timeout``). A rank
    that neither joins nor exits is an error after ``timeout``."""
    keys = [_joined_key(proc.rank) for proc in processes]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        dead = _why_dead(processes, job)
        if dead:
            raise TensorParallelError(f"a spawned rank exited before joining: {'; '.join(dead)}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"spawned ranks did not join within {timeout:g}s")
        time.sleep(0.05)


def exit_with_parent() -> None:
    """A spawned rank exits as soon as rank 0 is gone (its parent pid changes), whatever it waits on: a
    receive fails by itself, but a rank inside an NCCL collective or a stuck kernel would otherwise wait for
    the watchdog."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="hybridkv-tp-parent-watch").start()

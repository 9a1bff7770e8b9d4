"""Run untrusted generated code in a sandbox that holds against code written to escape it.

Model-written code never runs in the evaluating process, nor as its user, nor where it can see the
scorer. A check is a pair: an untrusted ``program`` (prompt + completion) that defines a function, and
*trusted* test code that calls it. They run in two processes inside fresh user, PID, network, mount, IPC
and UTS namespaces: the candidate, as an unprivileged uid without capabilities (``no_new_privs``,
seccomp, rlimits, a read-only root and a private tmpfs), and the judge, PID 1 of the namespace, which runs
the test with ``candidate`` bound to a proxy: arguments and return values cross a pipe as plain data. The
verdict is the judge's alone, written on a pipe the candidate never holds, so a completion can fail its
own check in many ways but pass only by returning the right values. Everything of a check dies with the
judge, nothing of it touches the disk, and a killed scorer takes its sandboxes with it.

``hybridkv/eval/sandbox_worker.py`` holds the processes' code; ``docs/sandbox.md`` the threat model.
Where the kernel denies namespaces, ``Sandbox`` raises ``SandboxUnavailable`` unless
``SandboxLimits.unsafe_no_sandbox`` asks for plain child processes with resource limits only.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType

from hybridkv.eval import sandbox_worker
from hybridkv.eval.sandbox_worker import FrameTooLarge, read_frame, write_frame

STATUSES = ("passed", "failed", "timeout", "memory", "crashed")

# Extra wall time over ``timeout`` for setting up and tearing down a sandbox and for the trusted test.
_GRACE_S = 3.0
_REPLY_CAP = 1 << 16
_SETUP_ATTEMPTS = 3


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-check limits. ``cpu_seconds`` defaults to ceil(timeout) + 1 (a CPU-bound loop is stopped by the
    kernel even if it never yields); ``max_processes`` counts processes and threads the candidate may start
    besides itself; ``tmp_bytes`` bounds its private tmpfs (memory); ``max_reply_bytes`` one returned value
    (encoded). ``unsafe_no_sandbox`` runs without namespaces: resource limits only (docs/sandbox.md)."""

    timeout: float = 5.0
    memory_bytes: int = 1 << 30
    cpu_seconds: int | None = None
    file_size_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20
    max_processes: int = 0
    max_reply_bytes: int = 16 << 20
    unsafe_no_sandbox: bool = False

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"SandboxLimits.timeout must be positive, got {self.timeout}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"SandboxLimits.memory_bytes must be at least 64 MiB, got {self.memory_bytes}")
        for name in ("file_size_bytes", "tmp_bytes", "max_reply_bytes"):
            if getattr(self, name) < 1 << 16:
                raise ValueError(f"SandboxLimits.{name} must be at least 64 KiB, got {getattr(self, name)}")
        if self.max_processes < 0:
            raise ValueError(f"SandboxLimits.max_processes must be >= 0, got {self.max_processes}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise ValueError(f"SandboxLimits.cpu_seconds must be >= 1, got {self.cpu_seconds}")

    @property
    def cpu_limit(self) -> int:
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1

    def _wire(self) -> dict:
        return {**asdict(self), "cpu_seconds": self.cpu_limit, "grace_seconds": _GRACE_S}


@dataclass(frozen=True, kw_only=True)
class Check:
    """``program`` is untrusted source run by the candidate process. With a ``test`` (trusted source that
    defines ``check(candidate)``, run by the judge after ``setup``, e.g. the prompt's helper functions),
    the check passes iff ``check`` returns, ``candidate`` calling the program's ``entry_point``. Without
    one it passes iff the program runs to its end without raising; that verdict comes from the candidate
    process itself, so only a test makes it hold against a program written to cheat."""

    program: str
    entry_point: str | None = None
    test: str | None = None
    setup: str = ""

    def __post_init__(self) -> None:
        if self.test is not None and not self.entry_point:
            raise ValueError("Check: a test needs the entry_point it calls")


@dataclass(frozen=True, kw_only=True)
class ExecutionResult:
    status: str                  # one of STATUSES
    detail: str = ""             # exception type and message, signal, ...
    seconds: float = 0.0
    isolation: str = ""          # the mechanisms in force, e.g. "user-ns,pid-ns,...,seccomp"; "none" if unsafe

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class SandboxUnavailable(RuntimeError):
    """The kernel denies what the sandbox needs; nothing untrusted ran."""


class SandboxError(OSError):
    """The sandbox machinery itself failed (not the code under test)."""


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


class _Zygote:
    """One worker process (sandbox_worker.py): a started interpreter that forks a sandbox per check."""

    def __init__(self, limits: SandboxLimits):
        mode = "unsafe" if limits.unsafe_no_sandbox else "namespaces"
        # A clean environment: nothing of the scorer's (tokens, keys) is inherited by what it forks, but
        # TMPDIR (where the unsafe mode makes its working directories).
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        if "TMPDIR" in os.environ:
            env["TMPDIR"] = os.environ["TMPDIR"]
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(Path(sandbox_worker.__file__)), mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd="/", close_fds=True)
        probe = {"check": asdict(Check(program="")), "limits": replace(limits, timeout=30.0)._wire()}
        write_frame(self.proc.stdin.fileno(), {"site_dirs": _site_dirs(), "probe": probe})

    def receive(self, deadline: float) -> dict:
        try:
            reply = read_frame(self.proc.stdout.fileno(), _REPLY_CAP, deadline)
        except (EOFError, TimeoutError, FrameTooLarge, ValueError) as err:
            self.close()
            raise SandboxError(f"the sandbox worker stopped answering ({type(err).__name__})") from None
        if type(reply) is not dict or "fatal" in reply:
            self.close()
            raise SandboxError(f"the sandbox worker failed:\n{reply.get('fatal') if type(reply) is dict else reply}")
        return reply

    def request(self, obj: dict, deadline: float) -> dict:
        try:
            write_frame(self.proc.stdin.fileno(), obj, deadline)
        except (BrokenPipeError, TimeoutError) as err:
            self.close()
            raise SandboxError(f"the sandbox worker is gone ({type(err).__name__})") from None
        return self.receive(deadline)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()          # the worker kills its sandbox and exits on end of input
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if not stream.closed:
                stream.close()


class Sandbox:
    """``workers`` sandbox workers; ``run`` may be called from that many threads at once. Raises
    ``SandboxUnavailable`` (after a probe check) where the kernel denies namespaces."""

    def __init__(self, limits: SandboxLimits | None = None, *, workers: int = 1):
        self.limits = limits or SandboxLimits()
        self._idle: queue.SimpleQueue[_Zygote] = queue.SimpleQueue()
        self._all: list[_Zygote] = []
        self._lock = threading.Lock()
        try:
            self._all = [_Zygote(self.limits) for _ in range(max(1, workers))]
            hellos = [z.receive(time.monotonic() + 60) for z in self._all]
        except BaseException:
            self.close()
            raise
        refused = [h["setup_error"] for h in hellos if h.get("setup_error")]
        failed = [f"{h.get('status')}: {h.get('detail')}" for h in hellos if h.get("status") != "passed"]
        if refused or failed:
            self.close()
        if failed and not refused:
            raise SandboxError(f"the sandbox's self-check failed ({failed[0]})")
        if refused:
            raise SandboxUnavailable(
                f"the hybridkv sandbox cannot isolate untrusted code on this machine ({refused[0]}); it needs a "
                "kernel that lets this user create user, PID, network, mount and IPC namespaces "
                "(user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1 where that exists, no "
                "AppArmor or container seccomp policy denying unshare). Refusing to run untrusted code; "
                "--unsafe-no-sandbox runs it without isolation (resource limits only)")
        self.isolation: str = hellos[0]["isolation"]
        for z in self._all:
            self._idle.put(z)

    def run(self, check: Check) -> ExecutionResult:
        request = {"check": asdict(check), "limits": self.limits._wire()}
        for attempt in range(_SETUP_ATTEMPTS):
            reply = self._request(request)
            if "setup_error" not in reply:
                break
            # Setting up failed before any untrusted code ran (e.g. the kernel was short of memory for a
            # namespace): safe to try again.
            time.sleep(0.05 * (attempt + 1))
        else:
            raise SandboxError(f"setting up the sandbox failed: {reply['setup_error']}")
        status = reply.get("status")
        return ExecutionResult(status=status if status in STATUSES else "crashed", detail=str(reply.get("detail", "")),
                               seconds=float(reply.get("seconds", 0.0)), isolation=self.isolation)

    def _request(self, request: dict) -> dict:
        zygote = self._idle.get()
        try:
            reply = zygote.request(request, time.monotonic() + self.limits.timeout + _GRACE_S + 30)
        except SandboxError:
            with self._lock:
                self._all.remove(zygote)
                replacement = _Zygote(self.limits)
                self._all.append(replacement)
            hello = replacement.receive(time.monotonic() + 60)
            if hello.get("status") != "passed":
                raise SandboxError(f"a restarted sandbox worker failed its self-check ({hello})") from None
            self._idle.put(replacement)
            raise
        self._idle.put(zygote)
        return reply

    def close(self) -> None:
        for z in self._all:
            z.close()
        self._all = []

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


@functools.cache
def sandbox_unavailable_reason() -> str | None:
    """Why this machine cannot run the sandbox (the ``SandboxUnavailable`` message), or None if it can.
    Probed once per process."""
    try:
        Sandbox(SandboxLimits(timeout=10.0)).close()
    except SandboxUnavailable as err:
        return str(err)
    return None


def run_checks(checks: Sequence[Check], limits: SandboxLimits | None = None, *, workers: int | None = None,
               progress: Callable[[int], None] | None = None) -> list[ExecutionResult]:
    """Run every check, ``workers`` at a time (default: one per CPU); results in input order.
    ``progress(1)`` is called as each check finishes (e.g. ``tqdm.update``)."""
    if not checks:
        return []
    workers = max(1, min(workers or os.cpu_count() or 1, len(checks)))
    with Sandbox(limits, workers=workers) as sandbox, ThreadPoolExecutor(max_workers=workers) as pool:
        def run(check: Check) -> ExecutionResult:
            result = sandbox.run(check)
            if progress is not None:
                progress(1)
            return result

        return list(pool.map(run, checks))


def run_programs(programs: Sequence[str], limits: SandboxLimits | None = None, *, workers: int | None = None,
                 progress: Callable[[int], None] | None = None) -> list[ExecutionResult]:
    """``run_checks`` for test-less programs ("passed": ran to the end without raising)."""
    return run_checks([Check(program=p) for p in programs], limits, workers=workers, progress=progress)


def run_program(program: str, limits: SandboxLimits | None = None) -> ExecutionResult:
    return run_programs([program], limits, workers=1)[0]

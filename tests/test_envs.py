"""Environment variables: ``hybridkv/envs.py`` is the one module that reads them, every ``HYBRIDKV_*`` name the
package mentions is documented there, and its accessors parse strictly."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hybridkv import envs

PACKAGE = Path(__file__).resolve().parent.parent / "hybridkv"

# Modules other than envs.py that may touch ``os.environ``, and why (each to be routed through envs.py by its
# owner: the accessors exist there).
OTHER_READERS = {
    "engine/distributed.py": "copies this process's environment into the spawned ranks' (with their thread count "
                             "and hybridkv's root on PYTHONPATH)",
    "eval/sandbox.py": "PATH, handed to the sandboxed child",
    "eval/sandbox_worker.py": "replaces the sandboxed candidate's environment with a minimal one",
}
# HYBRIDKV_* names the package may mention without documenting them in envs.py.
UNDOCUMENTED: set[str] = set()


def _environment_reads(path: Path) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``os.putenv`` / ``os.unsetenv`` uses and ``from os import environ``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            found.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"line {node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in ("environ", "getenv", "putenv", "unsetenv")]
    return found


def _sources() -> dict[str, Path]:
    return {path.relative_to(PACKAGE).as_posix(): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_only_envs_reads_the_environment() -> None:
    readers = {rel: reads for rel, path in _sources().items() if (reads := _environment_reads(path))}
    assert "envs.py" in readers                     # the check itself sees reads
    stray = {rel: reads for rel, reads in readers.items() if rel != "envs.py" and rel not in OTHER_READERS}
    assert not stray, f"read environment variables through hybridkv/envs.py, not directly: {stray}"


def test_every_hybridkv_variable_is_documented() -> None:
    documented = {v.name for v in envs.VARIABLES}
    for rel, path in _sources().items():
        if rel == "envs.py":
            continue
        for name in set(re.findall(r"\bHYBRIDKV_[A-Z0-9_]+", path.read_text())):
            assert name in documented | UNDOCUMENTED, f"{rel} mentions {name}, which hybridkv/envs.py does not list"


def test_the_registry_is_complete() -> None:
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    for v in envs.VARIABLES:
        assert v.type in ("bool", "int", "str") and v.meaning, v
    source = (PACKAGE / "envs.py").read_text()
    for name in re.findall(r'"([A-Z][A-Z0-9_]+)"', source.split("VARIABLES:", 1)[1]):
        assert name in names, name                  # every name an accessor reads is listed


@pytest.mark.parametrize(("value", "want"), [(None, False), ("", False), ("0", False), ("off", False),
                                             ("1", True), ("true", True), ("YES", True), (" on ", True)])
def test_bool_variables(monkeypatch: pytest.MonkeyPatch, value: str | None, want: bool) -> None:
    if value is None:
        monkeypatch.delenv("HYBRIDKV_DEBUG", raising=False)
    else:
        monkeypatch.setenv("HYBRIDKV_DEBUG", value)
    assert envs.debug() is want


def test_bad_values_are_errors_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_DEBUG", "2")
    with pytest.raises(ValueError, match="HYBRIDKV_DEBUG='2'"):
        envs.debug()
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE='two': expected an integer"):
        envs.torchrun_world()


def test_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert envs.torchrun_world() is None
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not set"):
        envs.master_address()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert envs.torchrun_world() == (4, 3, 3)                 # LOCAL_RANK defaults to RANK
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert envs.torchrun_world() == (4, 3, 1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert envs.master_address() == ("127.0.0.1", 29500)


def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "anything")
    assert not envs.triton_interpret()


def test_hf_cache_search_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert envs.hf_cache_dirs() == [tmp_path / "home" / "datasets", tmp_path / "home" / "hub"]
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert envs.hf_cache_dirs() == [tmp_path / "ds", tmp_path / "home" / "datasets", tmp_path / "hub"]

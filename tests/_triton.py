"""Importing Triton kernel modules in tests. Without CUDA the kernels run under Triton's interpreter
(``conftest.py`` sets ``TRITON_INTERPRET`` before collection); a kernel module imported compiled earlier in the
process is reloaded so its kernels are re-decorated for the interpreter (it decides at decoration time)."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def kernel_module(name: str) -> ModuleType:
    """``name`` imported for this process's mode (compiled with CUDA, interpreted without); skips the calling
    test module when triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed")
    if not HAS_CUDA and name in sys.modules:
        importlib.reload(sys.modules[name])
    return importlib.import_module(name)


@contextlib.contextmanager
def tiles(module: ModuleType, function: str, overrides: dict[str, Any] | None) -> Iterator[None]:
    """Inside the block, ``module.<function>`` (a kernel's launch-configuration rule) returns its choice updated
    with ``overrides``: tiny test shapes then run several tiles, column blocks or split-K slices. ``None``: the
    rule as it is."""
    if not overrides:
        yield
        return
    rule = getattr(module, function)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, function, lambda *args, **kwargs: {**rule(*args, **kwargs), **overrides})
        yield


_HOPPER_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(fn, consts, ptrs, *, num_warps, default_ptr="*fp32", floats=("scale",)):
    \"\"\"``fn`` compiled for sm_90: ``consts`` its constexprs, ``ptrs`` pointer types by argument name (others
    ``default_ptr``), scalars i32 except the names in ``floats``.\"\"\"
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        elif name.endswith("_ptr"):
            signature[name] = ptrs.get(name, default_ptr)
        else:
            signature[name] = "fp32" if name in floats else "i32"
    out = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps})
    assert out.asm["cubin"]
    return out
"""


def build_for_hopper(snippet: str) -> str:
    """Run ``snippet`` (which may call ``build(fn, consts, ptrs, num_warps=...)``) in a child process without
    TRITON_INTERPRET (the interpreter never lowers a kernel, and it decides at decoration time), so a kernel that
    cannot be compiled for sm_90 fails on a CPU machine too; returns its stdout."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _HOPPER_BUILD + snippet], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout

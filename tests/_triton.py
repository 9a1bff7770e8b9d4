"""Importing Triton kernel modules in tests. Without CUDA the kernels run under Triton's interpreter
(``conftest.py`` sets ``TRITON_INTERPRET`` before collection); a kernel module imported compiled earlier in the
process is reloaded so its kernels are re-decorated for the interpreter (it decides at decoration time)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
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

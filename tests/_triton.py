"""Importing Triton kernel modules in tests. Without CUDA the kernels run under Triton's interpreter
(``conftest.py`` sets ``TRITON_INTERPRET`` before collection); a kernel module imported compiled earlier in the
process is reloaded so its kernels are re-decorated for the interpreter (it decides at decoration time)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

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

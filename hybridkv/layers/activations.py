"""Activation functions by name (the names used in HybridConfig)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": _relu2,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]

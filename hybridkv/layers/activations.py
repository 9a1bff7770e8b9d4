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
    "sigmoid": torch.sigmoid,     # a gate (Qwen3-Next's attention output gate), not an MLP activation
}


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation, in HF's order and rounding (``GptOssExperts._apply_gate``): the gate clamped
    above at ``limit``, up on both sides, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]

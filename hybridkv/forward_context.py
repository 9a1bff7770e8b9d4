"""Per-step mapping from each layer's cache name to its group's built inputs.

The model's forward takes token ids and positions only; a layer looks up what it needs for this step
here. A context manager sets and restores it, so nothing global is ever reset by hand and nested or
concurrent (thread-local / task-local) steps cannot leak into each other.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any

from hybridkv.backends.registry import KernelBackend, torch_backend


@dataclass(frozen=True, kw_only=True)
class ForwardContext:
    """``inputs`` maps a layer cache name (``HybridConfig.layer_cache_name``) to its group's inputs
    (``AttentionInputs`` / ``MambaInputs``); every layer of a group shares one object."""

    inputs: Mapping[str, Any]
    backend: KernelBackend


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("hybridkv_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("a cache-using layer ran outside a step: wrap the forward in "
                           "`with forward_context(...)` (the model runner does this)")
    return ctx


@cache
def _reference_ops() -> KernelBackend:
    return torch_backend()


def current_ops() -> KernelBackend:
    """The kernel backend of the running step, for cache-free ops (norms, activations); a module called on
    its own, outside a step, gets the torch references."""
    ctx = _CURRENT.get()
    return ctx.backend if ctx is not None else _reference_ops()

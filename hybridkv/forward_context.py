"""Per-step mapping from each layer's cache name to its group's built inputs.

The model's forward takes token ids and positions only; a layer looks up what it needs for this step
here. A context manager sets and restores it, so nothing global is ever reset by hand and nested or
concurrent (thread-local / task-local) steps cannot leak into each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import torch

from hybridkv.backends.registry import KernelBackend, torch_backend


class GraphBreaks(Protocol):
    """What a mixed-step graph capture puts in the context (``engine/mixed_graphs.py``): called instead of each
    ``metadata_op``, it ends the graph being captured, records the op, starts the next graph and returns the
    tensor the op will write at each replay."""

    def __call__(self, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...],
                 shape: tuple[int, ...], dtype: torch.dtype, key: str | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class ForwardContext:
    """``inputs`` maps a layer cache name (``HybridConfig.layer_cache_name``) to its group's inputs
    (``AttentionInputs`` / ``MambaInputs``); every layer of a group shares one object."""

    inputs: Mapping[str, Any]
    backend: KernelBackend
    graph_breaks: GraphBreaks | None = None


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


def metadata_op(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, shape: tuple[int, ...],
                dtype: torch.dtype, key: str | None = None) -> torch.Tensor:
    """``fn(*tensors)``: the part of a layer's forward that reads the step's inputs (its group's ``inputs`` here:
    KV writes, attention, state-slot updates), returning a ``shape`` / ``dtype`` tensor. Each tensor's first
    dimension is the step's tokens, and so is the result's; ``fn`` reads the context when it runs, not before.
    Use the result before the second ``metadata_op`` call after this one: that call may overwrite it.

    A layer keeps every other part of its forward free of step inputs, so the mixed-step graphs
    (``engine/mixed_graphs.py``) can capture it for a padded token count: they break the graph at each of these
    calls and run ``fn`` eagerly on the step's real tokens at each replay, except where they hold static inputs for
    ``key`` (the cache name whose inputs ``fn`` reads: full and sliding-window attention and Mamba2,
    ``mixed_metadata.py``), which they capture. Elsewhere a plain call."""
    ctx = _CURRENT.get()
    if ctx is None or ctx.graph_breaks is None:
        return fn(*tensors)
    return ctx.graph_breaks(fn, tensors, shape, dtype, key)


@cache
def _reference_ops() -> KernelBackend:
    return torch_backend()


def current_ops() -> KernelBackend:
    """The kernel backend of the running step, for cache-free ops (norms, activations); a module called on
    its own, outside a step, gets the torch references."""
    ctx = _CURRENT.get()
    return ctx.backend if ctx is not None else _reference_ops()

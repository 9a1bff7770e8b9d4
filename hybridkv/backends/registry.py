"""Kernel backends: a named set of ops with the signatures of the ``*_ref`` reference twins.

``torch`` (the references) runs everywhere and is complete. ``triton`` replaces what it has kernels for.
The vendor backends ``flash_attn``, ``mamba_ssm`` (mamba-ssm + causal-conv1d) and ``fla`` (flash-linear-attention:
the gated delta rule and KDA) derive from ``triton`` and replace only the ops their packages provide. Asking for a
backend that is not installed, or not usable on the device, is a clear error, never a silent change of math path.

``auto`` on CUDA composes the best available: ``triton`` (or ``torch`` without triton) plus, from every
importable vendor backend, the ops measured faster than triton's (``_AUTO_OPS``), e.g. ``triton+mamba_ssm``.
A vendor op that cannot run a call's configuration raises ``UnsupportedConfig`` naming the constraint
(before touching any state): an explicitly chosen backend lets it propagate; under ``auto`` the call falls
back to the op it replaced, logged once per reason.
The choice is logged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.backends.base import KernelBackend, UnsupportedConfig, torch_backend

logger = logging.getLogger("hybridkv.backends")

__all__ = ["KernelBackend", "UnsupportedConfig", "available_backends", "get_backend", "torch_backend"]


# Lazy factories: the Triton and vendor modules import their optional packages at module level, so they are
# imported only when their backend is built (and they import ``base``, never this module).
def _triton() -> KernelBackend:
    from hybridkv.backends.triton_backend import triton_backend

    return triton_backend()


def _flash_attn_ops() -> dict[str, Callable[..., Any]]:
    from hybridkv.backends.vendor_flash_attn import flash_attn_ops

    return flash_attn_ops()


def _mamba_ssm_ops() -> dict[str, Callable[..., Any]]:
    from hybridkv.backends.vendor_mamba import mamba_ssm_ops

    return mamba_ssm_ops()


def _fla_ops() -> dict[str, Callable[..., Any]]:
    from hybridkv.backends.vendor_fla import fla_ops

    return fla_ops()


@dataclass(frozen=True, kw_only=True)
class _Entry:
    factory: Callable[[], KernelBackend] | None = None           # None: named, not built yet
    requires: tuple[str, ...] = ()                                # importable modules it needs
    cuda_only: bool = False
    # vendor backends: the ops they replace on top of ``base`` (may raise ImportError: broken install)
    vendor_ops: Callable[[], dict[str, Callable[..., Any]]] | None = None
    base: str = "triton"
    install: str = "pip install 'hybridkv[cuda]'"                # what brings the required packages


_REGISTRY: dict[str, _Entry] = {
    "torch": _Entry(factory=torch_backend),
    "triton": _Entry(factory=_triton, requires=("triton",), cuda_only=True),
    "flash_attn": _Entry(vendor_ops=_flash_attn_ops, requires=("triton", "flash_attn"), cuda_only=True),
    "mamba_ssm": _Entry(vendor_ops=_mamba_ssm_ops, requires=("triton", "mamba_ssm", "causal_conv1d"),
                        cuda_only=True),
    "fla": _Entry(vendor_ops=_fla_ops, requires=("triton", "fla"), cuda_only=True,
                  install="pip install flash-linear-attention"),
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _importable(module: str) -> bool:
    """Cheap presence check (no import); a module already in ``sys.modules`` counts as present."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    entry = _REGISTRY[name]
    missing = [m for m in entry.requires if not _importable(m)]
    if missing:
        return f"needs the package(s) {', '.join(missing)} ({entry.install})"
    if entry.cuda_only and device.type != "cuda":
        return f"runs on CUDA devices only, not {device.type}"
    if entry.factory is None and entry.vendor_ops is None:
        return "is not implemented in this version of hybridkv"
    return None


def _vendor_ops(name: str) -> dict[str, Callable[..., Any]]:
    """The vendor ops of ``name``; an installed package that fails to import is a clear error."""
    entry = _REGISTRY[name]
    assert entry.vendor_ops is not None
    try:
        return entry.vendor_ops()
    except ImportError as e:
        raise RuntimeError(f"kernel backend {name!r}: its package is installed but does not import ({e})") from e


def _build(name: str) -> KernelBackend:
    entry = _REGISTRY[name]
    if entry.vendor_ops is None:
        assert entry.factory is not None
        return entry.factory()
    ops = _vendor_ops(name)
    base = _build(entry.base)
    logger.info("kernel backend %s: %s from %s, the other ops from %s", name, ", ".join(ops), name, base.name)
    return _with_rope_attention(dataclasses.replace(base, name=name, **ops), replaced=ops)


def _with_rope_attention(backend: KernelBackend, *, replaced: dict[str, Callable[..., Any]]) -> KernelBackend:
    """A backend whose ``paged_attention`` or ``qk_rope_write_kv`` was replaced runs ``rope_attention`` as those
    two ops, so the ops it names are the ones every batch gets (the base's fused kernel would bypass them)."""
    if not {"paged_attention", "qk_rope_write_kv"} & replaced.keys() or "rope_attention" in replaced:
        return backend
    from hybridkv.layers.ops.fused_ref import compose_rope_attention

    return dataclasses.replace(backend, rope_attention=compose_rope_attention(backend.qk_rope_write_kv,
                                                                              backend.paged_attention))


_FALLBACKS_LOGGED: set[tuple[str, str, str]] = set()


def _with_fallback(vendor_op: Callable[..., Any], fallback_op: Callable[..., Any], *, fallback: str
                   ) -> Callable[..., Any]:
    """``vendor_op``, or ``fallback_op`` for a call the vendor kernel does not support (logged once per reason)."""

    def op(*args: Any, **kwargs: Any) -> Any:
        try:
            return vendor_op(*args, **kwargs)
        except UnsupportedConfig as e:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise       # the fallback may read host metadata: inside a CUDA graph it would go stale
            key = (e.backend, e.op, e.constraint)
            if key not in _FALLBACKS_LOGGED:
                _FALLBACKS_LOGGED.add(key)
                logger.warning("kernel backend auto: %s %s falls back to %s: %s", e.backend, e.op, fallback,
                               e.constraint)
            return fallback_op(*args, **kwargs)

    op.__name__ = getattr(vendor_op, "__name__", "vendor_op")
    op.__wrapped__ = vendor_op                      # type: ignore[attr-defined]
    op.fallback = fallback_op                       # type: ignore[attr-defined]
    return op


# Which vendor ops ``auto`` takes over triton's: only those measured faster on an H100
# (benchmarks/gpu_vendor.py; docs/performance.md, "Vendor backends"). Our Triton conv1d and SSD
# kernels beat mamba-ssm / causal-conv1d at every measured size (0.13-0.95x their time); mamba-ssm's Mamba-1
# state update beats our reference 4-5x. flash-attn 2's paged path (its split-KV kernel, at block size 256)
# was slower than our paged attention on all 15 measured shapes (ours 0.43-0.97x its time), so ``auto`` takes
# none of it; ``backend="flash_attn"`` still asks for it. fla-core 0.6.0 against our delta-rule kernels on an H200
# (benchmarks/gpu_delta_rule.py --quick, head dims 128, 1 x 4096 tokens): its chunked KDA prefill takes 0.27x our
# time (1.87 vs 6.93 ms), so ``auto`` takes it; its gated-delta-rule prefill takes 1.37-1.52x ours and its decode
# update (eager only: no CUDA graph) ~9x, so those stay ours (``backend="fla"`` asks for every fla op).
_AUTO_OPS: dict[str, frozenset[str]] = {
    "mamba_ssm": frozenset({"selective_state_update"}),
    "fla": frozenset({"kda"}),
}


# Triton ops that raise ``UnsupportedConfig`` for some configurations (attention: head_dim > 512).
_TRITON_REFUSING_OPS = ("paged_attention", "rope_attention")


def _auto(device: torch.device) -> KernelBackend:
    """CUDA: triton (else torch) plus every usable vendor backend's ops, each with a logged fallback."""
    if device.type != "cuda":
        logger.info("kernel backend: torch (auto, device %s)", device)
        return torch_backend()
    base_name = "triton" if _unavailable_reason("triton", device) is None else "torch"
    backend = _build(base_name)
    if base_name == "triton":        # a configuration triton's kernels refuse runs on the torch references
        ref = torch_backend()
        backend = dataclasses.replace(backend, **{
            op: _with_fallback(getattr(backend, op), getattr(ref, op), fallback="torch")
            for op in _TRITON_REFUSING_OPS})
    parts = [base_name]
    for name, entry in _REGISTRY.items():
        if entry.vendor_ops is None:
            continue
        if not _AUTO_OPS.get(name):
            logger.info("kernel backend auto: not using %s (none of its ops measured faster than triton's)", name)
            continue
        reason = _unavailable_reason(name, device)
        if reason is not None:
            logger.info("kernel backend auto: not using %s (it %s)", name, reason)
            continue
        try:
            ops = entry.vendor_ops()
        except ImportError as e:
            logger.warning("kernel backend auto: not using %s: its package is installed but does not import (%s)",
                           name, e)
            continue
        ops = {op: fn for op, fn in ops.items() if op in _AUTO_OPS[name]}
        backend = dataclasses.replace(backend, **{
            op: _with_fallback(fn, getattr(backend, op), fallback=base_name) for op, fn in ops.items()})
        parts.append(name)
    name = "+".join(parts)
    logger.info("kernel backend: %s (auto, device %s)", name, device)
    return dataclasses.replace(backend, name=name)


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> KernelBackend:
    """The backend called ``name`` for ``device``. ``auto``: on CUDA, triton plus every usable vendor
    backend (with per-call fallback, logged); elsewhere ``torch``. The choice is logged."""
    device = torch.device(device)
    if name == "auto":
        return _auto(device)
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(_REGISTRY)} or 'auto'")
    reason = _unavailable_reason(name, device)
    if reason is not None:
        raise RuntimeError(f"kernel backend {name!r} {reason}; use backend='torch' or 'auto'")
    backend = _build(name)
    logger.info("kernel backend: %s (requested, device %s)", backend.name, device)
    return backend

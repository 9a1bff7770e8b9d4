"""Kernel backends: a named set of ops with the signatures of the ``*_ref`` reference twins.

``torch`` (the references) runs everywhere and is complete. Fast backends register here too; asking
for one that is not installed or not built yet is a clear error, never a silent change of math path.
``auto`` picks the best installed backend for the device and logs the choice.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("hybridkv.backends")


@dataclass(frozen=True, kw_only=True)
class KernelBackend:
    """One implementation of every op a layer calls (signatures: ``hybridkv.layers.ops.*_ref``)."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]
    causal_conv1d: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    ssd_chunk_scan: Callable[..., torch.Tensor]
    ssd_state_update: Callable[..., torch.Tensor]
    selective_scan: Callable[..., torch.Tensor]
    selective_state_update: Callable[..., torch.Tensor]


def torch_backend() -> KernelBackend:
    """The reference ops: complete, any device. Other backends replace the ops they have kernels for."""
    from hybridkv.layers import ops

    return KernelBackend(
        name="torch",
        paged_attention=ops.paged_attention_ref,
        write_kv=ops.write_kv_ref,
        causal_conv1d=ops.causal_conv1d_ref,
        causal_conv1d_update=ops.causal_conv1d_update_ref,
        ssd_chunk_scan=ops.ssd_chunk_scan_ref,
        ssd_state_update=ops.ssd_state_update_ref,
        selective_scan=ops.selective_scan_ref,
        selective_state_update=ops.selective_state_update_mamba1_ref,
    )


@dataclass(frozen=True, kw_only=True)
class _Entry:
    factory: Callable[[], KernelBackend] | None   # None: named, not built yet
    requires: tuple[str, ...] = ()                 # importable modules it needs
    cuda_only: bool = False


_REGISTRY: dict[str, _Entry] = {
    "torch": _Entry(factory=torch_backend),
    "triton": _Entry(factory=lambda: importlib.import_module("hybridkv.backends.triton_backend").triton_backend(),
                     requires=("triton",), cuda_only=True),
    "flash_attn": _Entry(factory=None, requires=("flash_attn",), cuda_only=True),
    "mamba_ssm": _Entry(factory=None, requires=("mamba_ssm", "causal_conv1d"), cuda_only=True),
}


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    entry = _REGISTRY[name]
    missing = [m for m in entry.requires if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs the package(s) {', '.join(missing)} (pip install 'hybridkv[cuda]')"
    if entry.cuda_only and device.type != "cuda":
        return f"runs on CUDA devices only, not {device.type}"
    if entry.factory is None:
        return "is not implemented in this version of hybridkv"
    return None


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> KernelBackend:
    """The backend called ``name`` for ``device``; ``auto`` = the first usable of the registry order
    after ``torch`` on CUDA, else ``torch``. The choice is logged."""
    device = torch.device(device)
    if name == "auto":
        preferred = [n for n in _REGISTRY if n != "torch"] if device.type == "cuda" else []
        chosen = next((n for n in preferred if _unavailable_reason(n, device) is None), "torch")
        logger.info("kernel backend: %s (auto, device %s)", chosen, device)
        name = chosen
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(_REGISTRY)} or 'auto'")
    reason = _unavailable_reason(name, device)
    if reason is not None:
        raise RuntimeError(f"kernel backend {name!r} {reason}; use backend='torch' or 'auto'")
    factory = _REGISTRY[name].factory
    assert factory is not None
    return factory()

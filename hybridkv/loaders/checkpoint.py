"""An HF checkpoint directory -> a ready ``HybridModel``: config converted, weights loaded by hub name.

The model is built straight on the target device and dtype with parameter initialisation skipped
(every parameter is overwritten by the checkpoint, and random init of a 7B model costs more than
reading it), then filled by ``load_weights`` with the architecture's registered weight map.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from hybridkv.loaders.hf_config import load_config
from hybridkv.loaders.weights import get_weight_map, load_weights
from hybridkv.models.hybrid import HybridModel

# Initialisers module constructors call; patched to no-ops while building (as HF's no_init_weights).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "xavier_uniform_", "xavier_normal_",
                   "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "zeros_", "ones_")


@contextlib.contextmanager
def _bare_construction(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build modules on ``device`` in ``dtype`` without running initialisers. Buffers that must stay in
    fp32 (RoPE frequencies) are created with an explicit dtype by their modules. Not thread-safe: the
    torch.nn.init patch and the default dtype are process-wide for the duration."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    default_dtype = torch.get_default_dtype()
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        torch.set_default_dtype(dtype)
        with device:
            yield
    finally:
        torch.set_default_dtype(default_dtype)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu") -> HybridModel:
    """Load an HF checkpoint directory (``config.json`` + safetensors with hub weight names).

    ``dtype`` defaults to the checkpoint's; tensors are converted as they stream in, and the returned
    model's ``config.dtype`` is ``dtype``. An unsupported architecture is an error listing the
    supported ones, raised before anything is allocated."""
    path = Path(path)
    config = load_config(path)
    weight_map = get_weight_map(config.architecture)
    dtype = dtype or config.torch_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"load_hf_checkpoint: dtype must be a floating-point type, got {dtype}")
    # The model's config describes the model in memory: KV caches default to ``config.dtype``.
    config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    device = torch.device(device)
    with _bare_construction(device, dtype):
        model = HybridModel(config)
    for param in model.parameters():       # a few are created in fp32 on purpose (e.g. Mamba's A_log)
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    load_weights(model, path, weight_map, config=config)
    return model.eval()

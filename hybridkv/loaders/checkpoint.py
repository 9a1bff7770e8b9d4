"""An HF checkpoint directory -> a ready ``HybridModel``: config converted, weights loaded by hub name.

The model is built straight on the target device and dtype with parameter initialisation skipped
(every parameter is overwritten by the checkpoint, and random init of a 7B model costs more than
reading it), then filled by ``load_weights`` with the architecture's registered weight map.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridkv.layers.parallel import SINGLE, TensorParallel
from hybridkv.loaders.hf_config import load_config
from hybridkv.loaders.weights import get_weight_map, load_weights
from hybridkv.models.hybrid import HybridModel, bare_construction


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu", tp: TensorParallel = SINGLE) -> HybridModel:
    """Load an HF checkpoint directory (``config.json`` + safetensors with hub weight names).

    ``dtype`` defaults to the checkpoint's; tensors are converted as they stream in, and the returned
    model's ``config.dtype`` is ``dtype``. An unsupported architecture is an error listing the
    supported ones, raised before anything is allocated. With ``tp``, the model is this rank's shard:
    every tensor is read whole and cut to the rank's part as it streams in."""
    path = Path(path)
    config = load_config(path)
    weight_map = get_weight_map(config.architecture)
    dtype = dtype or config.torch_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"load_hf_checkpoint: dtype must be a floating-point type, got {dtype}")
    # The model's config describes the model in memory: KV caches default to ``config.dtype``.
    config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    device = torch.device(device)
    with bare_construction(device, dtype):
        model = HybridModel(config, tp=tp)
    for param in model.parameters():       # a few are created in fp32 on purpose (e.g. Mamba's A_log)
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    load_weights(model, path, weight_map, config=config)
    return model.eval()

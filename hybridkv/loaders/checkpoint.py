"""An HF checkpoint directory -> a ready ``HybridModel``: config converted, weights loaded by hub name.

Nothing is allocated until the checkpoint has been checked against the config: the model is first built on
the meta device (shapes only), every safetensors header is read and each hub tensor's shape is run through
the weight map against that meta model (``check_weights``), and the parameters must fit the device
(``check_fits``). Only then is the model built on the target device and dtype, with parameter initialisation
skipped (every parameter is overwritten by the checkpoint, and random init of a 7B model costs more than
reading it), and filled by ``load_weights`` with the architecture's registered weight map.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridkv.layers.parallel import SINGLE, TensorParallel
from hybridkv.loaders.hf_config import load_config
from hybridkv.loaders.weights import check_weights, get_weight_map, load_weights
from hybridkv.models.hybrid import HybridModel, empty_model, meta_model
from hybridkv.models.memory import check_device


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu", tp: TensorParallel = SINGLE) -> HybridModel:
    """Load an HF checkpoint directory (``config.json`` + safetensors with hub weight names).

    ``dtype`` defaults to the checkpoint's; tensors are converted as they stream in, and the returned
    model's ``config.dtype`` is ``dtype``. Before anything is allocated: an unsupported architecture is an
    error listing the supported ones, a bad config one naming the field, a corrupt file or a shard outside
    the directory one naming the file, a tensor whose shape disagrees with the config one naming it, and a
    model too large for the device one saying how much it needs. A weight that holds NaN or inf is an error
    naming it as it streams in. With ``tp``, the model is this rank's shard: every tensor is read whole and
    cut to the rank's part as it streams in."""
    path = Path(path)
    config = load_config(path)
    weight_map = get_weight_map(config.architecture)
    dtype = dtype or config.torch_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"load_hf_checkpoint: dtype must be a floating-point type, got {dtype}")
    # The model's config describes the model in memory: KV caches default to ``config.dtype``.
    config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    device = torch.device(device)
    check_device(device)
    try:
        meta = meta_model(config, dtype, tp=tp, device=device)
        check_weights(meta, path, weight_map, config=config)
        model = empty_model(config, dtype=dtype, device=device, tp=tp, meta=meta)
    except MemoryError as err:
        raise MemoryError(f"{path}: {err}") from None
    load_weights(model, path, weight_map, config=config)
    return model.eval()

"""``plan``: how a KV-cache memory budget serves a model, before anything is loaded.

A model is named by a config.json, a checkpoint directory, a bundled config name (``hybridkv/configs``,
e.g. "llama4-scout"), a config dict (HF or hybridkv-native) or a ``HybridConfig``. The plan itself is
``kv_groups.plan_kv_cache`` over ``HybridConfig.kv_specs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.kv_groups.plan import KVCachePlan, checkpoint_slots, plan_kv_cache
from hybridkv.kv_groups.specs import DEFAULT_BLOCK_SIZE
from hybridkv.loaders.hf_config import load_config
from hybridkv.models.config import HybridConfig
from hybridkv.utils import parse_bytes

BUNDLED_CONFIGS = Path(__file__).parent / "configs"

ModelSource = str | Path | Mapping[str, Any] | HybridConfig
DEFAULT_MAX_NUM_SEQS = 256             # the engine's (``LLM``) default


def bundled_config_names() -> tuple[str, ...]:
    """Names accepted in place of a path: the ``*.json`` files shipped in ``hybridkv/configs``."""
    return tuple(sorted(p.stem for p in BUNDLED_CONFIGS.glob("*.json")))


def resolve_config_path(name: str | Path) -> Path:
    """An existing file or directory, else the bundled config of that name."""
    path = Path(name)
    if path.exists():
        return path
    bundled = BUNDLED_CONFIGS / f"{name}.json"
    if isinstance(name, str) and "/" not in name and bundled.is_file():
        return bundled
    raise FileNotFoundError(f"{name}: no such file or directory, and not a bundled config "
                            f"(bundled: {', '.join(bundled_config_names())})")


def load_model_config(model: ModelSource) -> HybridConfig:
    """The ``HybridConfig`` of ``model`` (see the module docstring for what ``model`` may be)."""
    if isinstance(model, HybridConfig):
        return model
    if isinstance(model, Mapping):
        return load_config(model)
    return load_config(resolve_config_path(model))


def _torch_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown KV dtype {value!r} (examples: bfloat16, float16, float32)")
    return dtype


def plan(
    model: ModelSource,
    *,
    max_model_len: int | None = None,
    kv_memory: int | str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_dtype: str | torch.dtype | None = None,
    tensor_parallel_size: int = 1,
    enable_prefix_caching: bool = True,
    host_cache_memory: int | str = 0,
) -> KVCachePlan:
    """Split ``kv_memory`` (bytes, or a size such as "40GiB") into the block and state-slot pools and
    report how many ``max_model_len``-token requests fit (default: the model's max positions).

    KV and conv states use ``kv_dtype`` (default: the checkpoint dtype); SSM states are fp32. Raises
    ``ValueError`` when the budget cannot hold one request (the message says how many bytes it needs).
    With ``tensor_parallel_size`` > 1, ``kv_memory`` is one GPU's budget and the plan is one rank's: every
    byte figure is per GPU (its shard of each request), and the concurrency is the whole group's (every
    rank holds a shard of every running request, so all ranks admit the same requests). With prefix caching
    (and Mamba layers) the plan holds the engine's checkpoint slots (``checkpoint_slots``; ``max_num_seqs``
    defaults to the engine's 256 there), and ``host_cache_memory`` adds checkpoint slots in host memory."""
    config = load_model_config(model)
    length = config.max_position_embeddings if max_model_len is None else max_model_len
    specs = config.kv_specs(block_size=block_size, kv_dtype=_torch_dtype(kv_dtype),
                            tensor_parallel_size=tensor_parallel_size)
    if not specs:
        raise ValueError(f"{config.architecture} keeps no per-request state: nothing to plan")
    budget = parse_bytes(kv_memory)
    checkpoints = checkpoint_slots(specs, kv_memory=budget, max_num_seqs=max_num_seqs or DEFAULT_MAX_NUM_SEQS) \
        if enable_prefix_caching else 0
    return plan_kv_cache(specs, max_model_len=length, kv_memory=budget, max_num_seqs=max_num_seqs,
                         step_tokens=max_num_batched_tokens, num_checkpoint_slots=checkpoints,
                         host_checkpoint_memory=parse_bytes(host_cache_memory))

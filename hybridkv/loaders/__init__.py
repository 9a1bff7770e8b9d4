"""Loaders: HF config -> layer mix (``HybridConfig``); safetensors -> parameters (hub weight names)."""

from hybridkv.loaders.hf_config import (
    CONVERTERS,
    architecture_of,
    hf_config_to_hybrid,
    load_config,
    read_config_json,
    supported_architectures,
)

__all__ = [
    "CONVERTERS", "architecture_of", "hf_config_to_hybrid", "load_config", "read_config_json",
    "supported_architectures",
]

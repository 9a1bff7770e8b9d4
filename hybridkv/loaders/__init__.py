"""Loaders: HF config -> layer mix (``HybridConfig``); safetensors -> parameters (hub weight names)."""

from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.loaders.hf_config import (
    CONVERTERS,
    architecture_of,
    hf_config_to_hybrid,
    load_config,
    read_config_json,
    supported_architectures,
)
from hybridkv.loaders.tokenizer import load_tokenizer

__all__ = [
    "CONVERTERS", "architecture_of", "hf_config_to_hybrid", "load_config", "load_hf_checkpoint", "load_tokenizer",
    "read_config_json", "supported_architectures",
]

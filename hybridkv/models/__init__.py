"""Model descriptions (HybridConfig) and the generic hybrid decoder."""

from hybridkv.models.config import (
    MLP,
    Attention,
    GatedDeltaNet,
    HybridConfig,
    KimiDeltaAttention,
    Layer,
    Mamba1,
    Mamba2,
    MoE,
    MultiLatentAttention,
    Rope,
    SharedBlock,
    ShortConv,
)

__all__ = ["MLP", "Attention", "GatedDeltaNet", "HybridConfig", "KimiDeltaAttention", "Layer", "Mamba1", "Mamba2",
           "MoE", "MultiLatentAttention", "Rope", "SharedBlock", "ShortConv"]

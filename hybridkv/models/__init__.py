"""Model descriptions (HybridConfig) and the generic hybrid decoder."""

from hybridkv.models.config import (
    MLP,
    Attention,
    GatedDeltaNet,
    HybridConfig,
    Layer,
    Mamba1,
    Mamba2,
    MoE,
    Rope,
    SharedBlock,
    ShortConv,
)

__all__ = ["MLP", "Attention", "GatedDeltaNet", "HybridConfig", "Layer", "Mamba1", "Mamba2", "MoE", "Rope",
           "SharedBlock", "ShortConv"]

"""Bamba (``BambaForCausalLM``): Mamba2 layers with a few full-attention layers, a gated MLP in every
layer. Hub names are transformers' own (``model.`` prefix); the Mamba2 mixer's names are already ours.

The Mamba2 and layer-norm tables here are shared by the other Mamba2 hybrids (Falcon-H1, Granite-4.0-H,
NemotronH, Zamba2)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

MAMBA2_MODULES = ("in_proj", "conv1d", "norm", "out_proj")
MAMBA2_PARAMS = ("A_log", "D", "dt_bias")
GATED_MLP = ("gate", "up", "down")


def mamba2_modules(hf: str, ours: str) -> dict[str, str]:
    """Module renames for an HF Mamba2 mixer at ``hf`` that is our ``ours`` (same leaf names)."""
    return {f"{hf}.{m}": f"{ours}.{m}" for m in MAMBA2_MODULES}


def mamba2_param(rest: str, hf: str, ours: str) -> list[Target] | None:
    """The mixer's bare parameters (``A_log``, ``D``, ``dt_bias``): ``<hf>.<p>`` -> ``<ours>.<p>``."""
    module, _, leaf = rest.rpartition(".")
    return [Target(name=f"{ours}.{leaf}")] if module == hf and leaf in MAMBA2_PARAMS else None


def half(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Half ``i`` (0: gate, 1: up) of a fused gate|up tensor along its output dim (dim -2 of a weight,
    (E, 2I, H) for stacked experts; dim 0 of a bias)."""
    return lambda fused: fused.chunk(2, dim=0 if fused.ndim == 1 else -2)[i]


def fused_gate_up(module: str, suffix: str = "") -> list[Target]:
    """A fused gate|up tensor -> our ``<module>.gate_proj<suffix>`` and ``<module>.up_proj<suffix>``
    (``suffix`` ".weight" / ".bias" for a dense MLP, "" for stacked experts)."""
    return [Target(name=f"{module}.gate_proj{suffix}", transform=half(0)),
            Target(name=f"{module}.up_proj{suffix}", transform=half(1))]


_LAYER_MODULES = {
    **mamba2_modules("mamba", "mixer"), **LLAMA_ATTENTION,
    "input_layernorm": "input_norm", "pre_ff_layernorm": "ffn_norm",
    **{f"feed_forward.{p}_proj": f"ffn.{p}_proj" for p in GATED_MLP},
}
_TOP = {"embed_tokens.weight": "embed_tokens.weight", "final_layernorm.weight": "norm.weight"}


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    return (mamba2_param(rest, "mamba", f"layers.{i}.mixer")
            or rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}."))


bamba = register_weight_map("BambaForCausalLM")(decoder_map(layer=_layer, top=_TOP))

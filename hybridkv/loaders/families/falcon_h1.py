"""Falcon-H1 (``FalconH1ForCausalLM``): attention and Mamba2 side by side in every layer (ours:
``mixer`` and ``parallel_mixer``), then a gated MLP. Hub names are transformers' own (``model.``).

The µP multipliers are config data, not tensors; HF's ``mamba.mup_vector`` is a non-persistent buffer
derived from ``ssm_multipliers``, so a checkpoint that carries it anyway is read past (it is rebuilt
from the config)."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import GATED_MLP, mamba2_modules, mamba2_param
from hybridkv.loaders.families.mistral import IGNORED_SUFFIXES, LLAMA_ATTENTION, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_LAYER_MODULES = {
    **mamba2_modules("mamba", "parallel_mixer"), **LLAMA_ATTENTION,
    "input_layernorm": "input_norm", "pre_ff_layernorm": "ffn_norm",
    **{f"feed_forward.{p}_proj": f"ffn.{p}_proj" for p in GATED_MLP},
}
_TOP = {"embed_tokens.weight": "embed_tokens.weight", "final_layernorm.weight": "norm.weight"}


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    return (mamba2_param(rest, "mamba", f"layers.{i}.parallel_mixer")
            or rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}."))


falcon_h1 = register_weight_map("FalconH1ForCausalLM")(
    decoder_map(layer=_layer, top=_TOP, ignored=(*IGNORED_SUFFIXES, "mamba.mup_vector")))

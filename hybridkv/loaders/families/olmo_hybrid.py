"""OLMo-Hybrid (``OlmoHybridForCausalLM``): Gated DeltaNet layers with Llama's pre-norms beside OLMo-3
attention layers with post-norms only.

Hub names (which ``save_pretrained`` writes too; HF renames them on load): DeltaNet layers
``linear_attn.{q,k,v}_proj`` (concatenated into our ``mixer.in_proj_qkv``), ``linear_attn.{q,k,v}_conv1d``
(concatenated into ``mixer.conv1d``; HF's own ``conv1d`` is read too), ``g_proj`` / ``b_proj`` / ``a_proj`` /
``o_proj`` / ``o_norm`` (ours ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj`` / ``norm``), ``A_log``,
``dt_bias``; norms ``attention_layer_norm`` (HF ``input_layernorm``) and ``feedforward_layer_norm`` (HF
``post_attention_layernorm``, the FFN's pre-norm). Attention layers: ``self_attn.{q,k,v,o}_proj`` and the
all-heads ``self_attn.{q,k}_norm``; ``feedforward_layer_norm`` / ``post_attention_layernorm`` (HF renames the
first to the second) normalises the attention *output* (our ``post_mixer_norm``) and ``post_feedforward_layernorm``
the MLP output. Both spellings of each renamed tensor are read."""

from __future__ import annotations

import torch

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_MLP, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import Attention, HybridConfig

_DELTANET = {"g_proj": "in_proj_z", "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_proj": "out_proj",
             "o_norm": "norm", "conv1d": "conv1d"}
_PRE_NORM_LAYER = {
    **LLAMA_MLP, **{f"linear_attn.{hub}": f"mixer.{ours}" for hub, ours in _DELTANET.items()},
    "attention_layer_norm": "input_norm", "input_layernorm": "input_norm",
    "feedforward_layer_norm": "ffn_norm", "post_attention_layernorm": "ffn_norm",
}
_POST_NORM_LAYER = {
    **LLAMA_ATTENTION, **LLAMA_MLP, "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm",
    "feedforward_layer_norm": "post_mixer_norm", "post_attention_layernorm": "post_mixer_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}


def _concatenated(ours: str, hub: str, parts: str) -> Target:
    """``hub`` ("...{}...") for "q", then "k" and "v" read with it, concatenated along dim 0 into ``ours``."""
    return Target(name=ours, transform=lambda q, k, v: torch.cat([q, k, v]),
                  inputs=tuple(hub.format(p) for p in parts[1:]))


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if i >= len(config.layers):
        return None
    if isinstance(config.layers[i].mixer, Attention):
        return rename_module(rest, _POST_NORM_LAYER, prefix=f"layers.{i}.")
    hub = f"model.layers.{i}.linear_attn."
    if rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
        return [Target(name=f"layers.{i}.mixer.{rest.removeprefix('linear_attn.')}")]
    if rest == "linear_attn.q_proj.weight":
        return [_concatenated(f"layers.{i}.mixer.in_proj_qkv.weight", hub + "{}_proj.weight", "qkv")]
    if rest == "linear_attn.q_conv1d.weight":
        return [_concatenated(f"layers.{i}.mixer.conv1d.weight", hub + "{}_conv1d.weight", "qkv")]
    if rest in ("linear_attn.k_proj.weight", "linear_attn.v_proj.weight", "linear_attn.k_conv1d.weight",
                "linear_attn.v_conv1d.weight"):
        return []                                   # read with their q part
    return rename_module(rest, _PRE_NORM_LAYER, prefix=f"layers.{i}.")


olmo_hybrid = register_weight_map("OlmoHybridForCausalLM")(decoder_map(layer=_layer))

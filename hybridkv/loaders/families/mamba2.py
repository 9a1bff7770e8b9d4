"""Mamba2 (``Mamba2ForCausalLM``, e.g. Mamba-Codestral): ``backbone.``-prefixed blocks of one norm and
one mixer; the mixer's parameter names are already ours."""

from __future__ import annotations

from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import HybridConfig

_MIXER = ("in_proj", "conv1d", "norm", "out_proj")
_LAYER_MODULES = {"norm": "input_norm", **{f"mixer.{m}": f"mixer.{m}" for m in _MIXER}}
_MIXER_PARAMS = ("mixer.A_log", "mixer.D", "mixer.dt_bias")
_TOP = {"backbone.embeddings.weight": "embed_tokens.weight", "backbone.embedding.weight": "embed_tokens.weight",
        "backbone.norm_f.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


@register_weight_map("Mamba2ForCausalLM")
def mamba2(name: str, config: HybridConfig) -> list[Target] | None:
    if name in _TOP:
        return [Target(name=_TOP[name])]
    layer = split_layer(name.removeprefix("backbone.")) if name.startswith("backbone.") else None
    if layer is None:
        return None
    i, rest = layer
    if rest in _MIXER_PARAMS:
        return [Target(name=f"layers.{i}.{rest}")]
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")

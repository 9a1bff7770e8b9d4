"""EXAONE-4.0 (``Exaone4ForCausalLM``): the Llama tensor names with Olmo-2's post-norms and per-head q/k norms.

``post_attention_layernorm`` normalises the attention *output* (our ``post_mixer_norm``, as in Gemma, not the
FFN input as in Llama) and ``post_feedforward_layernorm`` the MLP output; there are no pre-norms."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_MLP, decoder_map
from hybridkv.loaders.weights import register_weight_map, rename_module

_LAYER_MODULES = {
    **LLAMA_ATTENTION, **LLAMA_MLP,
    "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm",
    "post_attention_layernorm": "post_mixer_norm", "post_feedforward_layernorm": "post_ffn_norm",
}

exaone4 = register_weight_map("Exaone4ForCausalLM")(decoder_map(
    layer=lambda i, rest, config: rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")))

"""LFM2 (``Lfm2ForCausalLM``): short-convolution and attention layers, each followed by a SwiGLU MLP.

Hub names (which ``save_pretrained`` writes too): ``model.layers.{i}.conv.{in_proj,conv,out_proj}`` (ours:
``mixer.*``, the same names), ``self_attn.{q,k,v,out}_proj`` and ``self_attn.{q,k}_layernorm``,
``feed_forward.w1`` / ``w3`` / ``w2`` (gate / up / down), ``operator_norm`` / ``ffn_norm``, and the final norm
``model.embedding_norm``."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import decoder_map
from hybridkv.loaders.weights import register_weight_map, rename_module

LAYER_MODULES = {
    **{f"conv.{p}": f"mixer.{p}" for p in ("in_proj", "conv", "out_proj")},
    **{f"self_attn.{p}_proj": f"mixer.{p}_proj" for p in "qkv"}, "self_attn.out_proj": "mixer.o_proj",
    "self_attn.q_layernorm": "mixer.q_norm", "self_attn.k_layernorm": "mixer.k_norm",
    "operator_norm": "input_norm", "ffn_norm": "ffn_norm",
}
DENSE_MLP = {"feed_forward.w1": "ffn.gate_proj", "feed_forward.w3": "ffn.up_proj", "feed_forward.w2": "ffn.down_proj"}
TOP = {"embed_tokens.weight": "embed_tokens.weight", "embedding_norm.weight": "norm.weight"}

_LAYER = {**LAYER_MODULES, **DENSE_MLP}
lfm2 = register_weight_map("Lfm2ForCausalLM")(decoder_map(
    layer=lambda i, rest, config: rename_module(rest, _LAYER, prefix=f"layers.{i}."), top=TOP))

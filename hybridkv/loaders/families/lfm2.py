"""LFM2 (``Lfm2ForCausalLM``) and LFM2-MoE (``Lfm2MoeForCausalLM``): short-convolution and attention layers, each
followed by a SwiGLU MLP or (LFM2-MoE, after its dense layers) routed experts.

Hub names (which ``save_pretrained`` writes too): ``model.layers.{i}.conv.{in_proj,conv,out_proj}`` (ours:
``mixer.*``, the same names), ``self_attn.{q,k,v,out}_proj`` and ``self_attn.{q,k}_layernorm``,
``feed_forward.w1`` / ``w3`` / ``w2`` (gate / up / down), ``operator_norm`` / ``ffn_norm``, the final norm
``model.embedding_norm``. Experts: ``feed_forward.gate`` (the router), ``feed_forward.expert_bias`` (ours: the
router's correction bias) and one tensor per expert, ``feed_forward.experts.{e}.w1`` / ``w3`` / ``w2``; 5.x's
in-memory stacked ``experts.gate_up_proj`` (E, 2I, H) / ``experts.down_proj`` (E, H, I) are read too."""

from __future__ import annotations

from hybridkv.loaders.families.jamba import routed_experts
from hybridkv.loaders.families.mistral import decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_LAYER_MODULES = {
    **{f"conv.{p}": f"mixer.{p}" for p in ("in_proj", "conv", "out_proj")},
    **{f"self_attn.{p}_proj": f"mixer.{p}_proj" for p in "qkv"}, "self_attn.out_proj": "mixer.o_proj",
    "self_attn.q_layernorm": "mixer.q_norm", "self_attn.k_layernorm": "mixer.k_norm",
    "operator_norm": "input_norm", "ffn_norm": "ffn_norm",
    "feed_forward.w1": "ffn.gate_proj", "feed_forward.w3": "ffn.up_proj", "feed_forward.w2": "ffn.down_proj",
    "feed_forward.gate": "ffn.router",
}
_EXPERT = {"w1.weight": "gate_proj", "w3.weight": "up_proj", "w2.weight": "down_proj"}
_TOP = {"embed_tokens.weight": "embed_tokens.weight", "embedding_norm.weight": "norm.weight"}


def _experts(rest: str, ours: str) -> list[Target] | None:
    expert, _, weight = rest.partition(".")
    if expert.isdigit() and weight in _EXPERT:          # the hub's per-expert w1 / w3 / w2
        rest = f"{expert}.{_EXPERT[weight]}.weight"
    return routed_experts(rest, ours)


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if rest == "feed_forward.expert_bias":
        return [Target(name=f"layers.{i}.ffn.correction_bias")]
    if rest.startswith("feed_forward.experts."):
        return _experts(rest.removeprefix("feed_forward.experts."), f"layers.{i}.ffn")
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


lfm2 = register_weight_map("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")(decoder_map(layer=_layer, top=_TOP))

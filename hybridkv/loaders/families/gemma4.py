"""Gemma-4's text decoder (``Gemma4ForCausalLM``, the decoder of ``Gemma4ForConditionalGeneration``).

Gemma-3's sandwich-norm layout plus the per-layer input (``per_layer_input_gate`` / ``per_layer_projection`` /
``post_per_layer_input_norm`` per layer, ``embed_tokens_per_layer`` / ``per_layer_model_projection`` /
``per_layer_projection_norm`` at the model level) and each layer's ``layer_scalar``. A KV-sharing layer has no
k/v projections or norms; released checkpoints may still store them (HF ignores them on load), so they are read
past. The value norm has no weight. With the MoE block (26B-A4B) the dense MLP, its extra norms, the router
(``proj``, ``scale``, ``per_expert_scale``) and the stacked experts (``gate_up_proj`` split) go inside ``ffn``.
The multimodal checkpoint keeps the decoder under ``model.language_model.``; its vision and audio towers and
embedders are skipped."""

from __future__ import annotations

from hybridkv.loaders.families.jamba import routed_experts
from hybridkv.loaders.families.mistral import IGNORED_SUFFIXES, LLAMA_ATTENTION, LLAMA_MLP, model_level
from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import Attention, DenseMoE, HybridConfig

_LAYER_MODULES = {
    **LLAMA_ATTENTION, **LLAMA_MLP,
    "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm",
    "input_layernorm": "input_norm", "post_attention_layernorm": "post_mixer_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm",
    "per_layer_input_gate": "per_layer.gate", "per_layer_projection": "per_layer.projection",
    "post_per_layer_input_norm": "per_layer.post_norm",
}
# the MoE block (26B-A4B): the dense MLP and its post-norm inside ``ffn``, the router and experts beside them
_MOE_LAYER_MODULES = {
    **{k: v for k, v in _LAYER_MODULES.items() if not k.startswith("mlp.")},
    **{f"mlp.{p}_proj": f"ffn.mlp.{p}_proj" for p in ("gate", "up", "down")},
    "post_feedforward_layernorm_1": "ffn.post_mlp_norm", "pre_feedforward_layernorm_2": "ffn.moe_norm",
    "post_feedforward_layernorm_2": "ffn.post_moe_norm", "router.proj": "ffn.moe.router",
}
_MODEL_LEVEL = {"embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                "per_layer_projection_norm.weight"}
_KV_MODULES = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")


def decoder(name: str, config: HybridConfig) -> list[Target] | None:
    """A tensor of the text decoder, named relative to the HF ``Gemma4TextModel``."""
    if name.endswith(IGNORED_SUFFIXES):
        return []
    if name in _MODEL_LEVEL:
        return [Target(name=name)]
    layer = split_layer(name)
    if layer is None:
        return model_level(name)
    i, rest = layer
    if rest == "layer_scalar":
        return [Target(name=f"layers.{i}.layer_scalar")]
    if rest in ("router.scale", "router.per_expert_scale"):
        return [Target(name=f"layers.{i}.ffn.{rest.replace('router.scale', 'router_scale').removeprefix('router.')}")]
    layer = config.layers[i] if i < len(config.layers) else None
    mixer = layer.mixer if layer is not None else None
    if isinstance(mixer, Attention) and mixer.kv_source is not None and rest.startswith(_KV_MODULES):
        return []                               # a KV-sharing layer's unused k/v weights
    if layer is not None and isinstance(layer.ffn, DenseMoE):
        if rest.startswith("experts."):
            return routed_experts(rest.removeprefix("experts."), f"layers.{i}.ffn.moe")
        return rename_module(rest, _MOE_LAYER_MODULES, prefix=f"layers.{i}.")
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


@register_weight_map("Gemma4ForCausalLM")
def gemma4_causal_lm(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    return decoder(name.removeprefix("model."), config) if name.startswith("model.") else None


@register_weight_map("Gemma4ForConditionalGeneration")
def gemma4_conditional_generation(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return decoder(name.removeprefix(prefix), config)
    if name.startswith(("model.", "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")):
        return []                               # vision / audio towers and their embedders
    return None

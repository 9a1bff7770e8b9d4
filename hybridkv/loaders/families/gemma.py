"""Gemma-2 / Gemma-3 (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, the text part of
``Gemma3ForConditionalGeneration``): the Llama layout plus the sandwich norms.

Gemma's ``post_attention_layernorm`` normalises the attention *output* (our ``post_mixer_norm``), not the
FFN input as in Llama; ``pre_feedforward_layernorm`` is the FFN input norm. The multimodal checkpoint
keeps the decoder under ``language_model.model.`` on the hub (transformers 5.x holds it in memory as
``model.language_model.``; both spellings are read) and its vision tower is skipped."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import IGNORED_SUFFIXES, LLAMA_ATTENTION, LLAMA_MLP, model_level
from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import HybridConfig

_LAYER_MODULES = {
    **LLAMA_ATTENTION, **LLAMA_MLP,
    "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm",
    "input_layernorm": "input_norm", "post_attention_layernorm": "post_mixer_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def _decoder(name: str) -> list[Target] | None:
    """A tensor of the text decoder, named relative to the HF ``GemmaXTextModel``."""
    if name.endswith(IGNORED_SUFFIXES):
        return []
    layer = split_layer(name)
    if layer is None:
        return model_level(name)
    i, rest = layer
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


@register_weight_map("Gemma2ForCausalLM", "Gemma3ForCausalLM")
def gemma_causal_lm(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    return _decoder(name.removeprefix("model.")) if name.startswith("model.") else None


@register_weight_map("Gemma3ForConditionalGeneration")
def gemma3_conditional_generation(name: str, config: HybridConfig) -> list[Target] | None:
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return [Target(name="lm_head.weight")]
    if name.startswith(_VISION_PREFIXES):
        return []
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return _decoder(name.removeprefix(prefix))
    return None

"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` and the text part of their multimodal
``...ForConditionalGeneration``): Qwen3-Next's tensor names, with the DeltaNet's projections unfused as
``linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a}`` (ours: ``mixer.*``, the same names).

The hub keeps the decoder under ``model.language_model.`` (HF's causal-LM classes load it from there and write
``model.``; both spellings are read). The vision tower (``model.visual.*``) and the multi-token-prediction head
(``mtp.*``) are read past, as HF's causal-LM model does; the experts come per expert or stacked (5.x)."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import decoder_map
from hybridkv.loaders.families.qwen3_next import layer
from hybridkv.loaders.weights import Target, register_weight_map
from hybridkv.models.config import HybridConfig

_decoder = decoder_map(layer=layer)
_LANGUAGE_MODEL = "model.language_model."


@register_weight_map("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration")
def qwen3_5(name: str, config: HybridConfig) -> list[Target] | None:
    if name.startswith(("mtp.", "model.visual.")):
        return []
    if name.startswith(_LANGUAGE_MODEL):
        name = "model." + name.removeprefix(_LANGUAGE_MODEL)
    return _decoder(name, config)

"""Gemma-3n's text decoder (``Gemma3nForCausalLM``, the decoder of ``Gemma3nForConditionalGeneration``).

Gemma-4's names (``gemma4.decoder``: sandwich norms, q/k norms, per-layer inputs, KV-sharing layers' stored k/v read
past) plus each layer's ``altup.*`` and ``laurel.*`` and the model's ``altup_projections`` /
``altup_unembed_projections``, all under their HF names. The multimodal checkpoint keeps the decoder under
``model.language_model.``; its vision and audio towers and embedders are skipped."""

from __future__ import annotations

from hybridkv.loaders.families.gemma4 import decoder
from hybridkv.loaders.weights import Target, register_weight_map, split_layer
from hybridkv.models.config import HybridConfig

_ALTUP_PREFIXES = ("altup_projections.", "altup_unembed_projections.")
_LAYER_PREFIXES = ("altup.", "laurel.")


def _decoder(name: str, config: HybridConfig) -> list[Target] | None:
    """A tensor of the text decoder, named relative to the HF ``Gemma3nTextModel``."""
    if name.startswith(_ALTUP_PREFIXES):
        return [Target(name=name)]
    layer = split_layer(name)
    if layer is not None and layer[1].startswith(_LAYER_PREFIXES):
        return [Target(name=name)]
    return decoder(name, config)


@register_weight_map("Gemma3nForCausalLM")
def gemma3n_causal_lm(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    return _decoder(name.removeprefix("model."), config) if name.startswith("model.") else None


@register_weight_map("Gemma3nForConditionalGeneration")
def gemma3n_conditional_generation(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return _decoder(name.removeprefix(prefix), config)
    if name.startswith(("model.", "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")):
        return []                               # vision / audio towers and their embedders
    return None

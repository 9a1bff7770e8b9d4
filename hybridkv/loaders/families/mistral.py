"""Mistral (``MistralForCausalLM``): the Llama layout, every layer sliding-window attention.

The Llama-style tables here are shared by the other attention families (Llama-4, Gemma)."""

from __future__ import annotations

from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import HybridConfig

# HF module path inside a decoder layer -> ours.
LLAMA_ATTENTION = {f"self_attn.{p}_proj": f"mixer.{p}_proj" for p in "qkvo"}
LLAMA_MLP = {f"mlp.{p}_proj": f"ffn.{p}_proj" for p in ("gate", "up", "down")}
LLAMA_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "ffn_norm"}

# Buffers some older checkpoints carry (recomputed here from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def model_level(name: str) -> list[Target] | None:
    """``embed_tokens`` and the final ``norm`` of an HF ``XxxModel`` (names without its prefix)."""
    if name == "embed_tokens.weight":
        return [Target(name="embed_tokens.weight")]
    if name == "norm.weight":
        return [Target(name="norm.weight")]
    return None


@register_weight_map("MistralForCausalLM")
def mistral(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    if not name.startswith("model."):
        return None
    name = name.removeprefix("model.")
    if name.endswith(IGNORED_SUFFIXES):
        return []
    layer = split_layer(name)
    if layer is None:
        return model_level(name)
    i, rest = layer
    return rename_module(rest, {**LLAMA_ATTENTION, **LLAMA_MLP, **LLAMA_NORMS}, prefix=f"layers.{i}.")

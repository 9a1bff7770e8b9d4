"""Mistral (``MistralForCausalLM``): the Llama layout, every layer sliding-window attention.

The Llama-style tables here are shared by the other attention families (Llama-4, Gemma)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridkv.loaders.weights import Target, WeightMap, register_weight_map, rename_module, split_layer
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


LayerMap = Callable[[int, str, HybridConfig], "list[Target] | None"]
LLAMA_TOP = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}


def decoder_map(*, layer: LayerMap, top: Mapping[str, str] = LLAMA_TOP, prefix: str = "model.",
                ignored: tuple[str, ...] = IGNORED_SUFFIXES) -> WeightMap:
    """The hub layout most families share: ``lm_head.weight``; under ``prefix`` the model-level tensors
    (``top``: hub name -> ours) and ``layers.<i>.<rest>``, which ``layer(i, rest, config)`` maps;
    buffers ending in ``ignored`` are read past. Anything else is unexpected (None)."""

    def weight_map(name: str, config: HybridConfig) -> list[Target] | None:
        if name == "lm_head.weight":
            return [Target(name="lm_head.weight")]
        if not name.startswith(prefix):
            return None
        name = name.removeprefix(prefix)
        if name.endswith(ignored):
            return []
        if name in top:
            return [Target(name=top[name])]
        parsed = split_layer(name)
        return None if parsed is None else layer(*parsed, config)

    return weight_map


_MISTRAL_LAYER = {**LLAMA_ATTENTION, **LLAMA_MLP, **LLAMA_NORMS}
mistral = register_weight_map("MistralForCausalLM")(decoder_map(
    layer=lambda i, rest, config: rename_module(rest, _MISTRAL_LAYER, prefix=f"layers.{i}.")))

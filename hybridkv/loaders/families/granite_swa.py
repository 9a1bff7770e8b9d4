"""Granite-SWA (``GraniteSWAForCausalLM``): the Llama tensor names plus ``self_attn.sinks``, the learned sink
logit per head (gpt-oss's; HF's eager path applies it as ``sigmoid(lse - sink)``, the same softmax)."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_MLP, LLAMA_NORMS, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_ATTENTION_MODULES = {**LLAMA_ATTENTION, **LLAMA_NORMS}


def granite_swa_attention(i: int, rest: str) -> list[Target] | None:
    """Layer ``i``'s attention tensors (sinks included) and its two norms (shared with GraniteMoE-SWA); None for
    any other name."""
    if rest == "self_attn.sinks":
        return [Target(name=f"layers.{i}.mixer.sinks")]
    return rename_module(rest, _ATTENTION_MODULES, prefix=f"layers.{i}.")


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    return granite_swa_attention(i, rest) or rename_module(rest, LLAMA_MLP, prefix=f"layers.{i}.")


granite_swa = register_weight_map("GraniteSWAForCausalLM")(decoder_map(layer=_layer))

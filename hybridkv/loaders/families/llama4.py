"""Llama-4 text (``Llama4ForCausalLM``, the text part of ``Llama4ForConditionalGeneration``).

Routed experts are stored fused on the hub and in transformers, laid out for ``x @ W``:
``experts.gate_up_proj`` (E, hidden, 2 * inter) with gate then up along the last dim, and
``experts.down_proj`` (E, inter, hidden). Ours are stacked ``nn.Linear`` layouts (E, out, in), so each is
transposed (and the fused one split). Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` tensors
(as some quantised re-exports store them) are read too. The multimodal checkpoint keeps the decoder
under ``language_model.``; its vision model and projector are skipped."""

from __future__ import annotations

import torch

from hybridkv.loaders.families.mistral import IGNORED_SUFFIXES, LLAMA_ATTENTION, LLAMA_NORMS, model_level
from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import HybridConfig

_LAYER_MODULES = {
    **LLAMA_ATTENTION, **LLAMA_NORMS,
    **{f"feed_forward.{p}_proj": f"ffn.{p}_proj" for p in ("gate", "up", "down")},         # dense layers
    **{f"feed_forward.shared_expert.{p}_proj": f"ffn.shared.{p}_proj" for p in ("gate", "up", "down")},
    "feed_forward.router": "ffn.router",
}
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


def _gate(fused: torch.Tensor) -> torch.Tensor:
    return fused.chunk(2, dim=-1)[0].transpose(-1, -2)


def _up(fused: torch.Tensor) -> torch.Tensor:
    return fused.chunk(2, dim=-1)[1].transpose(-1, -2)


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    return weight.transpose(-1, -2)


def _experts(i: int, rest: str) -> list[Target] | None:
    """``experts.*`` tensors of layer ``i`` (``rest`` without the ``feed_forward.experts.`` prefix)."""
    ours = f"layers.{i}.ffn"
    if rest == "gate_up_proj":
        return [Target(name=f"{ours}.gate_proj", transform=_gate), Target(name=f"{ours}.up_proj", transform=_up)]
    if rest == "down_proj":
        return [Target(name=f"{ours}.down_proj", transform=_transposed)]
    expert, _, proj = rest.partition(".")
    if expert.isdigit() and proj in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        return [Target(name=f"{ours}.{proj.removesuffix('.weight')}", index=(int(expert),))]
    return None


def _decoder(name: str) -> list[Target] | None:
    """A tensor of the text decoder, named relative to the HF ``Llama4TextModel``."""
    if name.endswith(IGNORED_SUFFIXES):
        return []
    layer = split_layer(name)
    if layer is None:
        return model_level(name)
    i, rest = layer
    if rest.startswith("feed_forward.experts."):
        return _experts(i, rest.removeprefix("feed_forward.experts."))
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


@register_weight_map("Llama4ForCausalLM")
def llama4_causal_lm(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    return _decoder(name.removeprefix("model.")) if name.startswith("model.") else None


@register_weight_map("Llama4ForConditionalGeneration")
def llama4_conditional_generation(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "language_model.lm_head.weight":
        return [Target(name="lm_head.weight")]
    if name.startswith(_VISION_PREFIXES):
        return []
    if name.startswith("language_model.model."):
        return _decoder(name.removeprefix("language_model.model."))
    return None

"""Jamba (``JambaForCausalLM``): Mamba-1 layers (with dt/B/C norms) and NoPE attention layers, each
with a dense MLP or a softmax MoE.

The hub stores routed experts one tensor per expert (``feed_forward.experts.{e}.{gate,up,down}_proj``),
and so does ``save_pretrained`` in transformers 5.23 (it reverts its load-time merge); 5.x's in-memory
fused form (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)) is read too."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import GATED_MLP, fused_gate_up
from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_MAMBA1_MODULES = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "dt_layernorm", "b_layernorm",
                   "c_layernorm")
_LAYER_MODULES = {
    **{f"mamba.{m}": f"mixer.{m}" for m in _MAMBA1_MODULES}, **LLAMA_ATTENTION,
    "input_layernorm": "input_norm", "pre_ff_layernorm": "ffn_norm",
    **{f"feed_forward.{p}_proj": f"ffn.{p}_proj" for p in GATED_MLP},       # dense layers
    "feed_forward.router": "ffn.router",
}
_TOP = {"embed_tokens.weight": "embed_tokens.weight", "final_layernorm.weight": "norm.weight"}


def routed_experts(rest: str, ours: str, projections: tuple[str, ...] = GATED_MLP) -> list[Target] | None:
    """``{e}.{p}_proj.weight`` (hub, per expert) or ``gate_up_proj`` / ``{p}_proj`` (5.x, stacked
    (E, out, in)) -> our stacked ``<ours>.{p}_proj``."""
    if rest == "gate_up_proj" and "gate" in projections:
        return fused_gate_up(ours)
    if rest in {f"{p}_proj" for p in projections}:
        return [Target(name=f"{ours}.{rest}")]
    expert, _, proj = rest.partition(".")
    if expert.isdigit() and proj in {f"{p}_proj.weight" for p in projections}:
        return [Target(name=f"{ours}.{proj.removesuffix('.weight')}", index=(int(expert),))]
    return None


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if rest in ("mamba.A_log", "mamba.D"):
        return [Target(name=f"layers.{i}.mixer.{rest.removeprefix('mamba.')}")]
    if rest.startswith("feed_forward.experts."):
        return routed_experts(rest.removeprefix("feed_forward.experts."), f"layers.{i}.ffn")
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


jamba = register_weight_map("JambaForCausalLM")(decoder_map(layer=_layer, top=_TOP))

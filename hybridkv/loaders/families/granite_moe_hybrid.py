"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``): Mamba2 or attention per layer, then routed experts
(when ``num_local_experts`` > 0) plus a shared gated MLP.

The hub keeps the GraniteMoE names, which ``save_pretrained`` in transformers 5.23 writes too:
``block_sparse_moe.input_linear.weight`` (E, 2I, H: gate then up), ``output_linear.weight`` (E, H, I),
``router.layer.weight``; 5.x's in-memory ``experts.gate_up_proj`` / ``experts.down_proj`` /
``router.weight`` are read as well. ``shared_mlp.input_linear`` is the fused gate|up of the shared MLP
(ours: ``ffn.shared``, or ``ffn`` itself in a dense model)."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import fused_gate_up, mamba2_modules, mamba2_param
from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig, MoE

_LAYER_MODULES = {**mamba2_modules("mamba", "mixer"), **LLAMA_ATTENTION,
                  "input_layernorm": "input_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}
_MOE = {"input_linear.weight": "gate_up", "experts.gate_up_proj": "gate_up",
        "output_linear.weight": "down_proj", "experts.down_proj": "down_proj",
        "router.layer.weight": "router.weight", "router.weight": "router.weight"}


def granite_moe_ffn(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    """Layer ``i``'s ``block_sparse_moe.*`` and ``shared_mlp.*`` tensors (GraniteMoE's names, shared with
    GraniteMoE-SWA); None for any other name."""
    ffn = config.layers[i].ffn if i < len(config.layers) else None
    ours = f"layers.{i}.ffn"
    if rest.startswith("shared_mlp."):
        shared = f"{ours}.shared" if isinstance(ffn, MoE) else ours
        if rest == "shared_mlp.input_linear.weight":
            return fused_gate_up(shared, ".weight")
        if rest == "shared_mlp.output_linear.weight":
            return [Target(name=f"{shared}.down_proj.weight")]
        return None
    kind = _MOE.get(rest.removeprefix("block_sparse_moe.")) if rest.startswith("block_sparse_moe.") else None
    if kind == "gate_up":
        return fused_gate_up(ours)
    return [Target(name=f"{ours}.{kind}")] if kind else None


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    return (mamba2_param(rest, "mamba", f"layers.{i}.mixer") or granite_moe_ffn(i, rest, config)
            or rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}."))


granite_moe_hybrid = register_weight_map("GraniteMoeHybridForCausalLM")(decoder_map(layer=_layer, top=_TOP))

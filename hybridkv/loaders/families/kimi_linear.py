"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention and NoPE multi-head latent attention layers, each
followed by a dense SwiGLU MLP (the first layer) or routed experts with a shared expert.

Hub names (which ``save_pretrained`` writes too): ``model.layers.{i}.self_attn.*`` for both mixers (ours:
``mixer.*``, the same names). KDA: ``{q,k,v}_proj``, ``{q,k,v}_conv1d`` (ours: the rows 0 / 1 / 2 of the stacked
``conv1d.weight``), ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``, ``b_proj``, ``g_a_proj``, ``g_b_proj``,
``o_norm``, ``o_proj``; MLA: ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. Experts: ``block_sparse_moe.gate`` (the router, with its
``e_score_correction_bias``), ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (gate / up / down),
``block_sparse_moe.shared_experts.{gate,up,down}_proj``; dense layers ``mlp.{gate,up,down}_proj``. transformers
5.x's in-memory names are read too: ``self_attn.conv1d`` (q|k|v stacked on dim 0), ``self_attn.forget_gate.*``,
``mlp.gate`` / ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` / ``mlp.shared_experts``, and the
dense MLP as ``save_pretrained`` writes it, ``block_sparse_moe.{gate,up,down}_proj``."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import GATED_MLP
from hybridkv.loaders.families.jamba import routed_experts
from hybridkv.loaders.families.mistral import LLAMA_MLP, LLAMA_NORMS, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_EXPERT = {"w1.weight": "gate_proj", "w3.weight": "up_proj", "w2.weight": "down_proj"}
_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
# transformers 5.x saves the dense MLP under the MoE's hub name too (it reverses its load-time rename of every
# ``block_sparse_moe.`` to ``mlp.``)
_SAVED_DENSE = {f"block_sparse_moe.{p}_proj": f"ffn.{p}_proj" for p in GATED_MLP}


def _moe(rest: str, ffn: str) -> list[Target] | None:
    """``gate.weight`` / ``gate.e_score_correction_bias``, ``experts.*``, ``shared_experts.*`` of one MoE block."""
    if rest == "gate.weight":
        return [Target(name=f"{ffn}.router.weight")]
    if rest == "gate.e_score_correction_bias":
        return [Target(name=f"{ffn}.correction_bias")]
    if rest.startswith("experts."):
        expert, _, weight = rest.removeprefix("experts.").partition(".")
        if expert.isdigit() and weight in _EXPERT:          # the hub's per-expert w1 / w3 / w2
            return routed_experts(f"{expert}.{_EXPERT[weight]}.weight", ffn)
        return routed_experts(rest.removeprefix("experts."), ffn)
    return rename_module(rest, {f"shared_experts.{p}_proj": f"shared.{p}_proj" for p in GATED_MLP}, prefix=f"{ffn}.")


def _mixer(rest: str, mixer: str) -> list[Target] | None:
    if rest in _CONVS:
        return [Target(name=f"{mixer}.conv1d.weight", index=(_CONVS.index(rest),))]
    if rest == "conv1d.weight":                  # (3 * qkv_dim, 1, kernel), q|k|v -> ours (3, qkv_dim, 1, kernel)
        return [Target(name=f"{mixer}.conv1d.weight", transform=lambda t: t.reshape(3, -1, *t.shape[1:]))]
    return [Target(name=f"{mixer}.{rest.removeprefix('forget_gate.')}")]


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if rest.startswith("self_attn."):
        return _mixer(rest.removeprefix("self_attn."), f"layers.{i}.mixer")
    for hub in ("block_sparse_moe.", "mlp."):
        if rest.startswith(hub) and (targets := _moe(rest.removeprefix(hub), f"layers.{i}.ffn")) is not None:
            return targets
    return rename_module(rest, {**LLAMA_MLP, **_SAVED_DENSE, **LLAMA_NORMS}, prefix=f"layers.{i}.")


kimi_linear = register_weight_map("KimiLinearForCausalLM")(decoder_map(layer=_layer))

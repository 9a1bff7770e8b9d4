"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet and gated attention layers, each followed by routed experts
with a gated shared expert (or a dense SwiGLU MLP).

Hub names (which ``save_pretrained`` writes too): ``model.layers.{i}.linear_attn.{in_proj_qkvz, in_proj_ba, conv1d,
dt_bias, A_log, norm, out_proj}`` (ours: ``mixer.*``, the same names, but for the two fused projections, whose rows
are reordered into ``in_proj_qkv`` / ``in_proj_z`` and ``in_proj_b`` / ``in_proj_a``: ``qwen3_next_rows``),
``self_attn.{q,k,v,o}_proj`` and ``self_attn.{q,k}_norm``, ``input_layernorm`` / ``post_attention_layernorm``;
experts: ``mlp.gate`` (the router), ``mlp.experts.{e}.{gate,up,down}_proj`` (or the stacked
``mlp.experts.gate_up_proj`` / ``down_proj`` of transformers 5.x in memory), ``mlp.shared_expert.{gate,up,down}_proj``,
``mlp.shared_expert_gate``; dense layers ``mlp.{gate,up,down}_proj``. The multi-token-prediction head (``mtp.*``) is
read past, as HF's model does."""

from __future__ import annotations

from functools import partial

from hybridkv.layers.gated_deltanet import qwen3_next_rows
from hybridkv.loaders.families.bamba import GATED_MLP
from hybridkv.loaders.families.jamba import routed_experts
from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_MLP, LLAMA_NORMS, decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_LAYER_MODULES = {
    **LLAMA_ATTENTION, **LLAMA_MLP, **LLAMA_NORMS,
    "self_attn.q_norm": "mixer.q_norm", "self_attn.k_norm": "mixer.k_norm",
    **{f"mlp.shared_expert.{p}_proj": f"ffn.shared.{p}_proj" for p in GATED_MLP},
    "mlp.shared_expert_gate": "ffn.shared_gate", "mlp.gate": "ffn.router",
}


_FUSED = {"linear_attn.in_proj_qkvz.weight": ("qkv", "z"), "linear_attn.in_proj_ba.weight": ("b", "a")}


def layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    """One decoder layer's tensor (Qwen3.5's too: its unfused DeltaNet projections keep HF's names as well)."""
    if rest.startswith("mlp.experts."):
        return routed_experts(rest.removeprefix("mlp.experts."), f"layers.{i}.ffn")
    fused = _FUSED.get(rest)
    if fused is not None:                                  # Qwen3-Next's per-key-head groups -> our head order
        cfg = config.layers[i].mixer
        return [Target(name=f"layers.{i}.mixer.in_proj_{part}.weight", transform=partial(qwen3_next_rows, part=part,
                                                                                         cfg=cfg))
                for part in fused]
    if rest.startswith("linear_attn."):                    # our GatedDeltaNetLayer keeps HF's names
        return [Target(name=f"layers.{i}.mixer.{rest.removeprefix('linear_attn.')}")]
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


_decoder = decoder_map(layer=layer)


@register_weight_map("Qwen3NextForCausalLM")
def qwen3_next(name: str, config: HybridConfig) -> list[Target] | None:
    return [] if name.startswith("mtp.") else _decoder(name, config)

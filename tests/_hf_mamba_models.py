"""Tiny random HF transformers models of the state-space hybrid families, saved as real checkpoints.

Every builder returns an fp32, eval, eager-attention HF model of 3-6 layers (hidden 64, vocab 160)
that exercises its family's distinctive parts: partial RoPE and biases (Bamba); Mamba-1 with dt/B/C
norms and softmax MoE on both layer kinds (Jamba); two shared blocks, one used twice, with q/k/v and
MLP adapters and RoPE (Zamba2); single-part layers, relu² MLP, grouped sigmoid MoE with a correction
bias, a latent space and a shared expert (NemotronH); every µP multiplier set away from 1, with and
without the gated norm (Falcon-H1); embedding / residual / attention / logit multipliers, MoE + shared
MLP, NoPE, and a dense RoPE variant (Granite-4.0-H); short convolutions with biases beside q/k-normed attention
and the SwiGLU width rule (LFM2); dense then sigmoid-routed expert layers with an expert bias (LFM2-MoE); Gated
DeltaNet beside gated attention with partial RoPE, zero-centred norms, softmax experts with a gated shared expert and
a dense layer (Qwen3-Next); the same with the DeltaNet's projections unfused, dense with tied embeddings, with
experts, and as the text part of a multimodal checkpoint (Qwen3.5); DeltaNet layers with doubled beta and unequal key
/ value head dims beside post-norm attention with all-heads q/k norms (OLMo-Hybrid).

Weights are re-drawn at a larger scale than HF's init (std 0.02 gives near-uniform logits, where
greedy decoding is decided by noise), and the SSM parameters are made non-trivial: A_log, D and the
dt bias random per head / channel, so a scan that mixes up heads, groups or the dt path shows up.
SSD chunks are 8 tokens, so a prompt of a few dozen tokens crosses many of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    Lfm2MoeConfig,
    Lfm2MoeForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    OlmoHybridConfig,
    OlmoHybridForCausalLM,
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
)

VOCAB = 160
HIDDEN = 64
_ROPE = {"rope_type": "default", "rope_theta": 1000.0}
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=4096, use_cache=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1) (N(0, 0.25²) when tied to the LM head, which
    keeps logits O(1-10) so a 1e-4 bound stays meaningful), norm weights ~ 1 + N(0, 0.1²), biases
    ~ N(0, 0.1²); Mamba: A = -U(0.5, 4), D ~ 1 + N(0, 0.5²), dt bias ~ N(-1, 0.7²) (softplus ~ 0.1-1.5);
    Zamba2's adapters at 0.3x (deltas on the shared projections; at full scale the random model is
    sensitive enough that fp32 round-off alone reaches ~1e-4 in the logits); MoE correction biases
    ~ N(0, 0.3²) (large enough to change which experts are chosen)."""
    gen = torch.Generator().manual_seed(seed)
    embed_std = 0.25 if model.config.tie_word_embeddings else 1.0
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(p.shape, generator=gen)
        if leaf == "A_log":
            p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=gen)))
        elif leaf == "D":
            p.copy_(1.0 + 0.5 * noise)
        elif leaf == "dt_bias" or name.endswith("dt_proj.bias"):
            p.copy_(-1.0 + 0.7 * noise)
        elif "norm" in name and p.ndim == 1:
            p.copy_(1.0 + 0.1 * noise)
        elif leaf == "bias":
            p.copy_(0.1 * noise)
        elif "embed" in name:
            p.copy_(embed_std * noise)
        elif "adapter_list" in name:        # Zamba2's per-use LoRA adapters: a delta on the shared weights
            p.copy_(0.3 * noise / p.shape[-1] ** 0.5)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)
    for name, buf in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


def _finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    model.config._attn_implementation = "eager"
    randomize(model, seed)
    return model.eval()


def bamba(seed: int = 0) -> PreTrainedModel:
    """Mamba2, attention, Mamba2, attention; RoPE on half of each head; biases on every projection;
    dt clamped at 1.2."""
    config = BambaConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_proj_bias=True, attention_bias=True,
        mlp_bias=True, time_step_limit=(0.0, 1.2), tie_word_embeddings=False, rope_parameters=dict(_ROPE))
    return _finish(BambaForCausalLM(config), seed)


def jamba(seed: int = 0) -> PreTrainedModel:
    """6 layers: attention (NoPE) at 1 and 4, Mamba-1 elsewhere; MoE (4 experts, top-2, softmax without
    renormalisation) at 1, 3, 5, so on both layer kinds."""
    config = JambaConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        use_mamba_kernels=False, tie_word_embeddings=False)
    return _finish(JambaForCausalLM(config), seed)


def zamba2(seed: int = 0) -> PreTrainedModel:
    """mamba, hybrid, mamba, hybrid, hybrid, mamba with 2 shared blocks: uses 0 and 2 share block 0
    (layers 1 and 4: one set of weights, two KV caches), use 1 is block 1; q/k/v and MLP adapters of
    rank 4; RoPE; tied embeddings."""
    config = Zamba2Config(
        **_COMMON, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        num_mem_blocks=2, num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_headdim=32,
        mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, chunk_size=8, adapter_rank=4,
        use_shared_attention_adapter=True, use_mem_rope=True, rope_parameters=dict(_ROPE),
        intermediate_size=96, hidden_act="gelu", time_step_min=0.01, tie_word_embeddings=True)
    return _finish(Zamba2ForCausalLM(config), seed)


def nemotron_h(seed: int = 0) -> PreTrainedModel:
    """Pattern M*EM-E: Mamba2, NoPE attention, MoE, Mamba2, relu² MLP, MoE. The MoE: 8 experts in 4
    groups (2 kept), top-2, sigmoid scores with a correction bias, scaling 2, a 32-wide latent space
    and a shared expert."""
    config = NemotronHConfig(
        **_COMMON, hybrid_override_pattern="M*EM-E", num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, mlp_hidden_act="relu2", mamba_num_heads=4, mamba_head_dim=32,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        moe_latent_size=32, routed_scaling_factor=2.0, norm_topk_prob=True, time_step_min=0.01,
        tie_word_embeddings=False)
    return _finish(NemotronHForCausalLM(config), seed)


def falcon_h1(seed: int = 0, *, rms_norm: bool = False) -> PreTrainedModel:
    """3 layers of attention beside Mamba2; every µP multiplier away from 1; out_proj bias without
    in_proj bias. ``rms_norm``: the gated norm on, applied before the gate (HF's default order), and dt
    clamped at 1.5 (otherwise HF's default unbounded limit, saved as 5.x's ``{"__float__": ...}``)."""
    config = FalconH1Config(
        **_COMMON, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_chunk_size=8, mamba_rms_norm=rms_norm, mamba_norm_before_gate=True, projectors_bias=True,
        mamba_proj_bias=False, attention_in_multiplier=0.8, key_multiplier=1.3, attention_out_multiplier=0.7,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
        mlp_multipliers=[1.1, 0.8], embedding_multiplier=1.5, lm_head_multiplier=0.6,
        rope_parameters=dict(_ROPE), time_step_limit=(0.0, 1.5) if rms_norm else (0.0, float("inf")),
        tie_word_embeddings=False)
    return _finish(FalconH1ForCausalLM(config), seed)


def granite(seed: int = 0, *, moe: bool = True) -> PreTrainedModel:
    """Mamba2, attention, Mamba2, attention with embedding x2, residual x0.5, attention scale 0.1 and
    logits / 4. ``moe``: 4 experts top-2 plus the shared MLP, NoPE, tied embeddings (as Granite-4.0-H);
    else the shared MLP alone (a dense model) with RoPE and dt clamped to [0.05, 2]."""
    config = GraniteMoeHybridConfig(
        **_COMMON, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4 if moe else 0, num_experts_per_tok=2, mamba_n_heads=4,
        mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0,
        position_embedding_type=None if moe else "rope", rope_parameters=dict(_ROPE),
        time_step_limit=(0.0, float("inf")) if moe else (0.05, 2.0), tie_word_embeddings=moe)
    return _finish(GraniteMoeHybridForCausalLM(config), seed)


def lfm2(seed: int = 0) -> PreTrainedModel:
    """conv, attention, conv, conv, attention: short convs of width 3 with biases (in_proj, conv, out_proj), RMS
    q/k norms before RoPE, tied embeddings; the MLP width from HF's rule (100 -> 2/3 -> x1.5 -> rounded up to
    16: 112)."""
    config = Lfm2Config(
        **_COMMON, intermediate_size=100, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"], conv_L_cache=3, conv_bias=True,
        block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5, block_multiple_of=16,
        rope_parameters=dict(_ROPE), tie_word_embeddings=True)
    return _finish(Lfm2ForCausalLM(config), seed)


def lfm2_moe(seed: int = 0) -> PreTrainedModel:
    """conv, attention, conv, conv, attention without conv biases; layers 0-1 a dense SwiGLU MLP, 2-4 8 experts,
    top-2 by sigmoid score + expert bias, renormalised and scaled by 1.5."""
    config = Lfm2MoeConfig(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=3, conv_bias=False, num_dense_layers=2, num_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=1.5, norm_topk_prob=True, rope_parameters=dict(_ROPE), tie_word_embeddings=False)
    return _finish(Lfm2MoeForCausalLM(config), seed)


def qwen3_next(seed: int = 0) -> PreTrainedModel:
    """DeltaNet, DeltaNet, attention, DeltaNet, attention: 2 key / 4 value heads of 16 (two value heads per key
    head), conv width 4; gated attention with biases, 4 heads / 2 kv heads of 16, half of each head rotated; layer 1
    a dense SwiGLU MLP, the others 8 experts top-2 (renormalised) with a sigmoid-gated shared expert."""
    config = Qwen3NextConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, attention_bias=True, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                       "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True,
        rope_parameters={**_ROPE, "partial_rotary_factor": 0.5}, tie_word_embeddings=False)
    return _zero_centred_norms(_finish(Qwen3NextForCausalLM(config), seed), seed)


@torch.no_grad()
def _zero_centred_norms(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Zero-centred norms scale by 1 + w: w ~ N(0, 0.1²) keeps them near 1, as HF's init."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


# Qwen3.5's text config: Qwen3-Next's layer mix and head layout, DeltaNet projections unfused. The multimodal RoPE
# sections cover the 4 rotated frequencies (half of a 16-wide head); text positions are equal on every axis.
_QWEN3_5 = dict(
    **_COMMON, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_parameters={**_ROPE, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def qwen3_5(seed: int = 0) -> PreTrainedModel:
    """Qwen3-Next's layers (DeltaNet, DeltaNet, attention, DeltaNet, attention) with the DeltaNet's projections
    unfused, a dense SwiGLU MLP on every layer and tied embeddings (as the small Qwen3.5 checkpoints). The tied
    embeddings are drawn at std 1/16: at ``randomize``'s 1/4 a 1e-7 relative change of the embeddings moves HF's own
    logits by up to 2e-4 on the parity prompts (fp32 round-off alone would break the 1e-4 bound); at 1/16 by 4e-5,
    as the untied models."""
    config = Qwen3_5TextConfig(**_QWEN3_5, intermediate_size=96, tie_word_embeddings=True)
    model = _zero_centred_norms(_finish(Qwen3_5ForCausalLM(config), seed), seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25)
    return model


def qwen3_5_moe(seed: int = 0) -> PreTrainedModel:
    """As ``qwen3_5`` with 8 experts top-2 (always renormalised) and a sigmoid-gated shared expert on every layer."""
    config = Qwen3_5MoeTextConfig(**_QWEN3_5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, tie_word_embeddings=False)
    return _zero_centred_norms(_finish(Qwen3_5MoeForCausalLM(config), seed), seed)


def qwen3_5_vl(seed: int = 0) -> PreTrainedModel:
    """``qwen3_5``'s decoder (untied) as the text part of a multimodal checkpoint with a one-block vision tower."""
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=HIDDEN, patch_size=4,
                  temporal_patch_size=2, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=dict(_QWEN3_5, intermediate_size=96), vision_config=vision,
                           tie_word_embeddings=False)
    return _zero_centred_norms(_finish(Qwen3_5ForConditionalGeneration(config), seed), seed)


def olmo_hybrid(seed: int = 0, rope: bool = True) -> PreTrainedModel:
    """DeltaNet, DeltaNet, attention, DeltaNet, attention: 2 key heads of 16 / 4 value heads of 24 (two value heads
    per key head, unequal head dims), beta doubled; post-norm attention, 4 heads / 2 kv heads of 16, q and k normed
    over all heads; RoPE (``rope=False``: a null theta, NoPE attention as HF builds it)."""
    config = OlmoHybridConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
        rope_parameters=dict(_ROPE) if rope else {"rope_type": "default", "rope_theta": None})
    return _finish(OlmoHybridForCausalLM(config), seed)


BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "bamba": bamba,
    "jamba": jamba,
    "zamba2": zamba2,
    "nemotron_h": nemotron_h,
    "falcon_h1": falcon_h1,
    "falcon_h1_gated_norm": lambda: falcon_h1(rms_norm=True),
    "granite_moe_hybrid": granite,
    "granite_dense_rope": lambda: granite(moe=False),
    "lfm2": lfm2,
    "lfm2_moe": lfm2_moe,
    "qwen3_next": qwen3_next,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_5_vl": qwen3_5_vl,
    "olmo_hybrid": olmo_hybrid,
    "olmo_hybrid_nope": lambda: olmo_hybrid(rope=False),
}


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int
              ) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation where every step is one full forward over the whole sequence (no HF cache:
    the safest oracle, see docs/design.md "Oracles"). Returns the new tokens and their (n, vocab) fp32 logits."""
    seq, rows = list(prompt), []
    for _ in range(max_new_tokens):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, position_ids=torch.arange(len(seq))[None], use_cache=False).logits
        rows.append(logits[0, -1].float())
        seq.append(int(rows[-1].argmax()))
    return seq[len(prompt):], torch.stack(rows)

"""``hybridkv.plan`` on released checkpoints' config.json (tests/_configs.py): groups, bytes and the
concurrency targets of docs/design.md ("Beyond existing runtimes", no padding and admission), asserted
exactly.

Byte arithmetic used below (bf16 KV, block 16): one token of one attention layer holds K and V,
2 x kv_heads x head_dim x 2 bytes; a pool page is (layers per group) x 16 tokens of that. A Mamba2 slot
holds the conv state (conv_dim x (kernel - 1), bf16) and the SSM state (heads x head_dim x state, fp32).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from _configs import (
    BAMBA_9B,
    COMMAND_R7B,
    EXAONE4_32B,
    GEMMA3_27B,
    GEMMA3N_E4B,
    GEMMA4_E4B,
    GPT_OSS_20B,
    GPT_OSS_120B,
    KIMI_LINEAR_48B_A3B,
    LFM2_1_2B,
    LFM2_8B_A1B,
    LLAMA4_SCOUT,
    MAMBA_CODESTRAL_7B,
    MISTRAL_7B,
    NEMOTRON_H_8B,
    OLMO_HYBRID_7B,
    QWEN3_5_35B_A3B,
    QWEN3_NEXT_80B_A3B,
    RELEASED,
)

from hybridkv import HybridConfig, plan
from hybridkv.kv_groups import KVCachePlan
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.planning import BUNDLED_CONFIGS, bundled_config_names

GiB = 1 << 30
BUDGET = 640 * GiB


def groups_by_kind(result: KVCachePlan) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for group in result.to_dict()["groups"]:
        out.setdefault(group["spec"], []).append(group)
    return out


def layer_ids(group: dict[str, Any]) -> list[int]:
    return [int(name.split(".")[1]) for name in group["layers"]]


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_bundled_configs_are_the_released_ones(name: str) -> None:
    assert json.loads((BUNDLED_CONFIGS / f"{name}.json").read_text()) == RELEASED[name]
    assert plan(name, kv_memory=BUDGET).to_dict() == plan(RELEASED[name], kv_memory=BUDGET).to_dict()


def test_bundled_names_include_the_demo_hybrid() -> None:
    assert set(RELEASED) | {"hybrid-demo"} == set(bundled_config_names())
    demo = plan("hybrid-demo", kv_memory=BUDGET)
    assert {g.kind for g in demo.groups} == {"mamba", "sliding_window", "chunked_local", "full"}
    assert isinstance(HybridConfig.load(BUNDLED_CONFIGS / "hybrid-demo.json"), HybridConfig)


def test_llama4_scout_at_128k() -> None:
    """48 layers: RoPE layers chunked-local (8192), every 4th NoPE layer global; 36 + 12 -> 4 groups of 12."""
    config = hf_config_to_hybrid(LLAMA4_SCOUT)
    assert (config.architecture, config.dtype, config.max_position_embeddings) == (
        "Llama4ForConditionalGeneration", "bfloat16", 262144)
    result = plan(LLAMA4_SCOUT, max_model_len=131072, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert [layer_ids(g) for g in kinds["chunked_local(8192)"]] == [
        [i for i in range(start, start + 16) if i % 4 != 3] for start in (0, 16, 32)]
    assert [layer_ids(g) for g in kinds["full"]] == [list(range(3, 48, 4))]
    page = 12 * 16 * (2 * 8 * 128 * 2)                                    # 786432 B
    assert result.page_bytes == page
    chunked = math.ceil((8192 + 1) / 16) * page                           # 513 blocks: chunk + 1 token
    full = 131072 // 16 * page
    assert [g["bytes_per_request_max"] for g in result.to_dict()["groups"]] == [chunked] * 3 + [full]
    assert result.bytes_per_request_max == 3 * chunked + full == 7_652_769_792
    assert result.bytes_per_request_if_all_full_attention == 4 * full == 25_769_803_776
    assert result.padding_bytes == 0
    assert result.concurrency_vs_all_full >= 3.2


def test_gemma3_27b_at_32k() -> None:
    """62 layers, every 6th global: 52 sliding (1024) + 10 full -> 31 groups of 2 layers."""
    result = plan(GEMMA3_27B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert len(kinds["sliding_window(1024)"]) == 26 and len(kinds["full"]) == 5
    assert sum((layer_ids(g) for g in kinds["full"]), []) == list(range(5, 62, 6))
    page = 2 * 16 * (2 * 16 * 128 * 2)                                    # 262144 B
    sliding = (math.ceil(1024 / 16) + 1) * page                           # window + 1 block
    full = 32768 // 16 * page
    assert result.bytes_per_request_max == 26 * sliding + 5 * full == 3_127_377_920
    assert result.bytes_per_request_if_all_full_attention == 31 * full
    assert result.padding_bytes == 0
    assert result.concurrency_vs_all_full >= 4.5


def test_gemma3_27b_rope_bases() -> None:
    config = hf_config_to_hybrid(GEMMA3_27B)
    local, glob = config.layers[0].mixer, config.layers[5].mixer
    assert (local.rope.theta, local.rope.scaling) == (10_000.0, None)
    assert (glob.rope.theta, glob.rope.scaling, glob.rope.factor) == (1_000_000.0, "linear", 8.0)
    assert local.scale == 168 ** -0.5 and config.eos_token_ids == (1, 106) and config.vocab_size == 262208


def test_gpt_oss_120b_at_128k() -> None:
    """36 layers alternating sliding (window 128) and full, from layer 0: 18 + 18 -> one group of each; the
    config names no dtype, so the KV plan is bf16 (the checkpoint's unquantized tensors)."""
    config = hf_config_to_hybrid(GPT_OSS_120B)
    assert (config.dtype, config.max_position_embeddings, config.vocab_size) == ("bfloat16", 131072, 201088)
    result = plan(GPT_OSS_120B, max_model_len=131072, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert [layer_ids(g) for g in kinds["sliding_window(128)"]] == [list(range(0, 36, 2))]
    assert [layer_ids(g) for g in kinds["full"]] == [list(range(1, 36, 2))]
    page = 18 * 16 * (2 * 8 * 64 * 2)                                    # 589824 B
    assert result.page_bytes == page
    sliding = (128 // 16 + 1) * page                                      # window + 1 block
    full = 131072 // 16 * page
    assert result.bytes_per_request_max == sliding + full == 4_837_146_624
    assert result.bytes_per_request_if_all_full_attention == 2 * full
    assert result.padding_bytes == 0
    assert (result.max_concurrent_requests, result.concurrency_vs_all_full) == (142, 2.0)


def test_gpt_oss_layers() -> None:
    """Sinks, biases and YaRN on every layer; the MoE as the released configs say (20b: 32 experts)."""
    for released, experts, layers in ((GPT_OSS_120B, 128, 36), (GPT_OSS_20B, 32, 24)):
        config = hf_config_to_hybrid(released)
        assert len(config.layers) == layers
        for i, layer in enumerate(config.layers):
            attention, moe = layer.mixer, layer.ffn
            assert attention.sliding_window == (128 if i % 2 == 0 else None)
            assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (64, 8, 64)
            assert attention.sinks and attention.qkv_bias and attention.o_bias
            assert (attention.rope.scaling, attention.rope.factor, attention.rope.theta, attention.rope.truncate,
                    attention.rope.original_max_position_embeddings) == ("yarn", 32.0, 150000.0, False, 4096)
            assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.router, moe.activation,
                    moe.swiglu_limit, moe.bias, moe.router_bias) == (experts, 4, 2880, "topk_softmax", "swiglu_oai",
                                                                      7.0, True, True)
        assert config.eos_token_ids == (200002,) and not config.tie_word_embeddings


@pytest.mark.parametrize(("released", "layers", "kv_heads"), [(COMMAND_R7B, 32, 8), (EXAONE4_32B, 64, 8)])
def test_sliding_hybrids_at_128k(released: dict[str, Any], layers: int, kv_heads: int) -> None:
    """Command-R7B and EXAONE-4.0-32B: three sliding layers (window 4096) per global one, so 3/4 of the layers
    hold 4096 + 16 tokens and 1/4 the whole context: 3 sliding groups + 1 full group of layers / 4 each."""
    result = plan(released, max_model_len=131072, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert len(kinds["sliding_window(4096)"]) == 3 and len(kinds["full"]) == 1
    assert layer_ids(kinds["full"][0]) == list(range(3, layers, 4))
    page = layers // 4 * 16 * (2 * kv_heads * 128 * 2)
    assert result.page_bytes == page
    sliding, full = (4096 // 16 + 1) * page, 131072 // 16 * page
    assert result.bytes_per_request_max == 3 * sliding + full
    assert result.bytes_per_request_if_all_full_attention == 4 * full
    assert result.padding_bytes == 0
    assert (result.max_concurrent_requests, round(result.concurrency_vs_all_full, 2)) == (    # the README's table
        {32: (146, 3.74), 64: (73, 3.84)}[layers])


def test_command_r7b_layers() -> None:
    """Sliding layers rotate (interleaved pairs), the global ones are NoPE; one LayerNorm feeds attention and MLP
    side by side; logits scaled by 0.25; tied embeddings."""
    config = hf_config_to_hybrid(COMMAND_R7B)
    assert (config.norm, config.logits_multiplier, config.tie_word_embeddings, config.eos_token_ids) == (
        "layer", 0.25, True, (255001,))
    for i, layer in enumerate(config.layers):
        attention = layer.mixer
        assert layer.parallel_ffn and (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (32, 8, 128)
        if i % 4 == 3:
            assert attention.sliding_window is None and attention.rope is None
        else:
            assert attention.sliding_window == 4096 and attention.rope.interleaved and attention.rope.theta == 50000.0


def test_exaone4_32b_layers() -> None:
    """Post-norms only, q/k norms, llama3 RoPE on the sliding layers and none on the global ones; the string
    pattern alone gives the same layers as the written-out ``layer_types``."""
    config = hf_config_to_hybrid(EXAONE4_32B)
    for i, layer in enumerate(config.layers):
        attention = layer.mixer
        assert (layer.pre_norm, layer.sandwich_norm, attention.qk_norm) == (False, True, "rms")
        if i % 4 == 3:
            assert attention.sliding_window is None and attention.rope is None
        else:
            assert (attention.sliding_window, attention.rope.scaling, attention.rope.factor) == (4096, "llama3", 16.0)
    assert hf_config_to_hybrid({k: v for k, v in EXAONE4_32B.items() if k != "layer_types"}) == config


def test_mistral_7b_at_32k() -> None:
    result = plan(MISTRAL_7B, max_model_len=32768, kv_memory=BUDGET)
    (group,) = result.to_dict()["groups"]
    assert (group["spec"], len(group["layers"]), group["blocks_per_request_max"]) == (
        "sliding_window(4096)", 32, 257)
    page = 32 * 16 * (2 * 8 * 128 * 2)                                    # 2 MiB
    assert result.bytes_per_request_max == 257 * page == 538_968_064
    assert result.bytes_per_request_if_all_full_attention == 2048 * page
    assert result.padding_bytes == 0
    assert result.concurrency_vs_all_full >= 6.5


def test_mamba_codestral_is_one_slot_per_request() -> None:
    result = plan(MAMBA_CODESTRAL_7B, max_model_len=32768, kv_memory=BUDGET)
    (group,) = result.to_dict()["groups"]
    conv = (8192 + 2 * 8 * 128) * 3 * 2
    ssm = 128 * 64 * 128 * 4
    assert (group["kind"], len(group["layers"]), group["num_slots"]) == ("mamba", 64, result.num_state_slots)
    assert result.bytes_per_request_max == 64 * (conv + ssm) == 272_367_616
    assert result.num_blocks == 0 and result.padding_bytes == 0
    assert result.max_concurrent_requests == (BUDGET - 64 * (conv + ssm)) // (64 * (conv + ssm))
    # No position limit in the config: the default length changes nothing for a pure Mamba model.
    assert plan(MAMBA_CODESTRAL_7B, kv_memory=BUDGET).bytes_per_request_max == 272_367_616


@pytest.mark.parametrize(("config", "attention_layers", "mamba_layers", "conv_dim"), [
    (NEMOTRON_H_8B, [7, 18, 29, 40], 24, 8192 + 2 * 8 * 128),
    (BAMBA_9B, [9, 18, 27], 29, 8192 + 2 * 1 * 128),
])
def test_mamba_hybrids_keep_small_blocks_and_no_padding(
        config: dict[str, Any], attention_layers: list[int], mamba_layers: int, conv_dim: int) -> None:
    result = plan(config, max_model_len=8192, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (full,) = kinds["full"]
    (mamba,) = [g for spec, gs in kinds.items() if spec.startswith("mamba(") for g in gs]
    assert layer_ids(full) == attention_layers and len(mamba["layers"]) == mamba_layers
    assert full["block_size"] == result.block_size == 16
    assert result.padding_bytes == 0
    page = len(attention_layers) * 16 * (2 * 8 * 128 * 2)
    slot = mamba_layers * (conv_dim * 3 * 2 + 128 * 64 * 128 * 4)
    assert result.bytes_per_request_max == 8192 // 16 * page + slot
    assert result.allocated_bytes <= result.budget_bytes


def test_lfm2_1_2b_conv_layers_are_one_small_slot() -> None:
    """16 layers: full attention at ``full_attn_idxs`` [2, 5, 8, 10, 12, 14], short convs elsewhere; a conv layer
    keeps (2048 channels x 2 inputs) bf16 per request, in the Mamba state-slot pool; the MLP is 8192 wide
    (12288 -> 2/3 -> rounded to 256)."""
    config = hf_config_to_hybrid(LFM2_1_2B)
    assert (config.dtype, config.tie_word_embeddings, config.eos_token_ids) == ("bfloat16", True, (7,))
    assert {layer.ffn.intermediate_size for layer in config.layers} == {8192}
    result = plan(LFM2_1_2B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (full,) = kinds["full"]
    (conv,) = kinds["mamba(2048x2)"]
    assert layer_ids(full) == [2, 5, 8, 10, 12, 14]
    assert layer_ids(conv) == [0, 1, 3, 4, 6, 7, 9, 11, 13, 15]
    page = 6 * 16 * (2 * 8 * 64 * 2)                                       # 196608 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    assert result.bytes_per_request_max == 32768 // 16 * page + 10 * 2048 * 2 * 2 == 402_735_104


def test_qwen3_next_80b_a3b_deltanet_layers_are_one_slot() -> None:
    """48 layers: gated full attention every 4th (3, 7, ..., 47: 2 kv heads of 256), Gated DeltaNet elsewhere; a
    DeltaNet layer keeps a bf16 conv state over q|k|v (2 x 16 x 128 + 32 x 128 = 8192 channels x 3) and an fp32
    recurrent state (32 value heads x 128 x 128) per request: 48 KiB + 2 MiB, in the Mamba state-slot pool. Every
    layer has 512 experts of 512, top-10, with a gated shared expert of 512."""
    config = hf_config_to_hybrid(QWEN3_NEXT_80B_A3B)
    assert (config.dtype, config.norm, config.eos_token_ids) == ("bfloat16", "gemma_rms", (151645,))
    moe = config.layers[0].ffn
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size, moe.shared_gate) == (
        512, 10, 512, 512, True)
    attention = config.layers[3].mixer
    assert attention.output_gate and attention.rope.partial_rotary_factor == 0.25 and attention.rope.theta == 1e7
    result = plan(QWEN3_NEXT_80B_A3B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (full,) = kinds["full"]
    (deltanet,) = kinds["mamba(8192x3 + 32x128x128)"]
    assert layer_ids(full) == list(range(3, 48, 4))
    assert layer_ids(deltanet) == [i for i in range(48) if i % 4 != 3]
    page = 12 * 16 * (2 * 2 * 256 * 2)                                      # 393216 B
    state = 8192 * 3 * 2 + 32 * 128 * 128 * 4                               # 2146304 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    assert result.bytes_per_request_max == 32768 // 16 * page + 36 * state == 882_573_312
    assert config.check_tensor_parallel(16) is None                         # 16 key heads: up to 16 ranks
    with pytest.raises(ValueError, match="num_k_heads"):
        config.check_tensor_parallel(32)


def test_kimi_linear_48b_a3b_latent_cache_and_kda_slots() -> None:
    """27 layers: MLA on 3, 7, ..., 23 and 26 (the hub's 1-indexed 4, 8, ..., 24, 27), KDA elsewhere. An MLA layer
    caches one latent row per token, kv_lora_rank 512 + rope key 64 = 576 bf16 values (1152 B, where per-head K and
    V would be 32 x (192 + 128) x 2 B = 20480 B); a KDA layer keeps a bf16 conv state over q|k|v (3 x 32 x 128 =
    12288 channels x 3) and an fp32 recurrent state (32 heads x 128 x 128): 72 KiB + 2 MiB. Layer 0 is a dense
    MLP, the others 256 experts of 1024, top-8 by sigmoid score + correction bias, with a shared expert."""
    config = hf_config_to_hybrid(KIMI_LINEAR_48B_A3B)
    assert (config.dtype, config.norm, config.eos_token_ids, config.max_position_embeddings) == (
        "bfloat16", "rms", (163586,), 1048576)
    moe = config.layers[1].ffn
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size, moe.router,
            moe.routed_scaling_factor) == (256, 8, 1024, 1024, "sigmoid_bias", 2.446)
    assert config.layers[0].ffn.intermediate_size == 9216
    result = plan(KIMI_LINEAR_48B_A3B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (mla,) = kinds["mla(512+64)"]
    (kda,) = kinds["mamba(12288x3 + 32x128x128)"]
    assert layer_ids(mla) == [3, 7, 11, 15, 19, 23, 26]
    assert layer_ids(kda) == [i for i in range(27) if i not in (3, 7, 11, 15, 19, 23, 26)]
    page = 7 * 16 * 576 * 2                                                 # 129024 B
    state = 12288 * 3 * 2 + 32 * 128 * 128 * 4                              # 2170880 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    assert result.bytes_per_request_max == 32768 // 16 * page + 20 * state == 307_658_752
    assert config.check_tensor_parallel(32) is None                         # 32 KDA and 32 MLA heads
    with pytest.raises(ValueError, match="num_heads"):
        config.check_tensor_parallel(64)
def test_qwen3_5_35b_a3b_text_part_plan() -> None:
    """The multimodal checkpoint's text part: 40 layers, gated attention every 4th (2 kv heads of 256), Gated DeltaNet
    elsewhere; per DeltaNet layer a bf16 conv state (2 x 16 x 128 + 32 x 128 = 8192 channels
    x 3) and an fp32 recurrent state (32 x 128 x 128); 256 experts of 512, top-8 renormalised, with a gated shared
    expert on every layer. The vision tower is not part of the plan."""
    config = hf_config_to_hybrid(QWEN3_5_35B_A3B)
    assert (config.architecture, config.dtype, config.norm, config.tie_word_embeddings) == (
        "Qwen3_5MoeForConditionalGeneration", "bfloat16", "gemma_rms", False)
    assert type(config.layers[0].mixer).__name__ == "GatedDeltaNet"
    moe = config.layers[0].ffn
    assert (moe.num_experts, moe.top_k, moe.renormalize, moe.shared_intermediate_size, moe.shared_gate) == (
        256, 8, True, 512, True)
    attention = config.layers[3].mixer
    assert attention.output_gate and attention.rope.partial_rotary_factor == 0.25 and attention.rope.theta == 1e7
    result = plan(QWEN3_5_35B_A3B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (full,) = kinds["full"]
    (deltanet,) = kinds["mamba(8192x3 + 32x128x128)"]
    assert layer_ids(full) == list(range(3, 40, 4))
    assert layer_ids(deltanet) == [i for i in range(40) if i % 4 != 3]
    page = 10 * 16 * (2 * 2 * 256 * 2)                                      # 327680 B
    state = 8192 * 3 * 2 + 32 * 128 * 128 * 4                               # 2146304 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    assert result.bytes_per_request_max == 32768 // 16 * page + 30 * state == 735_477_760


def test_olmo_hybrid_7b_plan() -> None:
    """32 layers: post-norm attention every 4th (30 kv heads of 128, q/k normed over all heads), pre-norm Gated
    DeltaNet elsewhere with 30 key heads of 96 and 30 value heads of 192: a bf16 conv state of 2 x 2880 + 5760 =
    11520 channels x 3 and an fp32 recurrent state of 30 x 96 x 192 per layer and request."""
    config = hf_config_to_hybrid(OLMO_HYBRID_7B)
    attention, deltanet = config.layers[3], config.layers[0]
    assert (attention.pre_norm, attention.sandwich_norm, attention.mixer.qk_norm) == (False, True, "rms_full")
    assert attention.mixer.rope.theta == 10000.0 and deltanet.pre_norm
    assert (deltanet.mixer.beta_scale, deltanet.mixer.norm_eps, config.eos_token_ids) == (2.0, 1e-5, (100257,))
    result = plan(OLMO_HYBRID_7B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    (full,) = kinds["full"]
    (states,) = kinds["mamba(11520x3 + 30x96x192)"]
    assert layer_ids(full) == list(range(3, 32, 4)) and len(states["layers"]) == 24
    page = 8 * 16 * (2 * 30 * 128 * 2)                                      # 1966080 B
    state = 11520 * 3 * 2 + 30 * 96 * 192 * 4                               # 2280960 B
    assert result.page_bytes == page and result.padding_bytes == 0
    assert result.bytes_per_request_max == 32768 // 16 * page + 24 * state == 4_081_274_880
    assert config.check_tensor_parallel(2) is None                          # 30 key / attention heads, 11008 wide
    with pytest.raises(ValueError, match="num_k_heads"):
        config.check_tensor_parallel(4)


def test_lfm2_8b_a1b_plan_and_experts() -> None:
    """24 layers: 6 attention, 18 short convs (2048 x 2 bf16 each per request); two dense layers, then 32 experts
    of 1792 top-4 routed by sigmoid score + expert bias."""
    config = hf_config_to_hybrid(LFM2_8B_A1B)
    assert [layer.ffn.intermediate_size for layer in config.layers[:3]] == [7168, 7168, 1792]
    assert (config.layers[2].ffn.num_experts, config.layers[2].ffn.top_k, config.layers[2].ffn.router) == (
        32, 4, "sigmoid_bias")
    result = plan(LFM2_8B_A1B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert layer_ids(kinds["full"][0]) == [2, 6, 10, 14, 18, 21]
    assert len(kinds["mamba(2048x2)"][0]["layers"]) == 18
    page = 6 * 16 * (2 * 8 * 64 * 2)
    assert result.padding_bytes == 0
    assert result.bytes_per_request_max == 32768 // 16 * page + 18 * 2048 * 2 * 2


def test_kv_dtype_and_block_size_options() -> None:
    fp32 = plan(MISTRAL_7B, max_model_len=32768, kv_memory=BUDGET, kv_dtype="float32")
    bf16 = plan(MISTRAL_7B, max_model_len=32768, kv_memory=BUDGET)
    assert fp32.page_bytes == 2 * bf16.page_bytes
    big = plan(LLAMA4_SCOUT, max_model_len=131072, kv_memory=BUDGET, block_size=64)
    assert big.block_size == 64 and big.padding_bytes == 0
    capped = plan(MISTRAL_7B, max_model_len=32768, kv_memory=BUDGET, max_num_seqs=8)
    assert capped.max_concurrent_requests == 8


def test_budget_too_small_says_how_many_bytes() -> None:
    with pytest.raises(ValueError, match=r"too small for one request .* it needs"):
        plan(MISTRAL_7B, max_model_len=32768, kv_memory="100MiB")


def test_gemma3n_e4b_shares_kv_across_its_last_15_layers() -> None:
    """35 layers, 4 sliding (512) : 1 global, all 2 kv heads of 256; the last 15 read the KV of layer 18 (sliding)
    or 19 (global) and own no pages. The 20 owners (16 sliding, 4 global) fill 4 sliding groups and 1 global group
    of 4 layers: a 16-token page of 128 KiB, no padding. AltUp (4 streams), Laurel and activation sparsity on the
    first 10 layers come through the converter."""
    config = hf_config_to_hybrid(GEMMA3N_E4B)
    assert (config.dtype, config.norm, config.final_softcap, config.per_layer_input_size, config.laurel_rank) == (
        "bfloat16", "rms", 30.0, 256, 64)
    assert config.altup is not None and config.altup.num_inputs == 4
    assert [layer.ffn.activation_sparsity for layer in config.layers] == [0.95] * 10 + [0.0] * 25
    donors = {i: layer.mixer.kv_source for i, layer in enumerate(config.layers) if layer.mixer.kv_source is not None}
    assert donors == {i: 19 if (i + 1) % 5 == 0 else 18 for i in range(20, 35)}
    result = plan(GEMMA3N_E4B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert [layer_ids(g) for g in kinds["sliding_window(512)"]] == [[0, 1, 2, 3], [5, 6, 7, 8], [10, 11, 12, 13],
                                                                     [15, 16, 17, 18]]
    assert [layer_ids(g) for g in kinds["full"]] == [[4, 9, 14, 19]]
    token = 2 * 2 * 256 * 2                                                  # K and V, 2 heads of 256, bf16
    page = 16 * 4 * token                                                    # 131072 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    sliding_blocks = -(-(511 + 1) // 16) + 1                                 # the window + 1 block
    assert result.bytes_per_request_max == (4 * sliding_blocks + 32768 // 16) * page
    assert {r for g in result.groups for r, _ in g.readers} == {f"layers.{i}" for i in range(20, 35)}
    # what the 15 readers would hold with caches of their own: 12 sliding + 3 global layers
    assert result.kv_shared_bytes_per_request == (12 * sliding_blocks * 16 + 3 * 32768) * token


def test_gemma4_e4b_shares_kv_and_sizes_groups_by_shape() -> None:
    """42 layers, 5 sliding (512, 2 kv heads of 256) : 1 global (2 kv heads of 512); the last 18 read the KV of
    layer 22 (sliding) or 23 (global) and own no pages. The 24 owners: 20 sliding + 4 global layers, a global one
    twice as wide, so 5 sliding groups of 4 and 2 global groups of 2 fill a 16-token page of 128 KiB exactly."""
    config = hf_config_to_hybrid(GEMMA4_E4B)
    assert (config.dtype, config.norm, config.final_softcap, config.per_layer_input_size) == (
        "bfloat16", "rms", 30.0, 256)
    donors = {i: layer.mixer.kv_source for i, layer in enumerate(config.layers) if layer.mixer.kv_source is not None}
    assert donors == {i: 23 if (i + 1) % 6 == 0 else 22 for i in range(24, 42)}
    result = plan(GEMMA4_E4B, max_model_len=32768, kv_memory=BUDGET)
    kinds = groups_by_kind(result)
    assert [len(g["layers"]) for g in kinds["sliding_window(512)"]] == [4] * 5
    assert [len(g["layers"]) for g in kinds["full"]] == [2, 2]
    page = 16 * 4 * (2 * 2 * 256 * 2)                                      # 131072 B
    assert result.page_bytes == page and result.padding_bytes == 0 and result.block_size == 16
    sliding_blocks = -(-(511 + 1) // 16) + 1                                 # the window + 1 block
    assert result.bytes_per_request_max == (5 * sliding_blocks + 2 * 32768 // 16) * page
    readers = {r for g in result.groups for r, _ in g.readers}
    assert readers == {f"layers.{i}" for i in range(24, 42)}
    # what the 18 readers would hold with caches of their own: 15 sliding + 3 global layers
    assert result.kv_shared_bytes_per_request == (15 * sliding_blocks * 16 * 2 * 2 * 256 * 2
                                                 + 3 * 32768 * 2 * 2 * 512 * 2)

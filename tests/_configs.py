"""Released ``config.json`` files of real checkpoints, as plain dicts (small facts, no weights).

The same dicts ship as ``hybridkv/configs/<name>.json`` (``hybridkv plan <name>``);
``test_plan_real_configs.py`` checks the two copies agree. Provenance of each is in its comment.
"""

from __future__ import annotations

import math

# meta-llama/Llama-4-Scout-17B-16E (base). Reconstructed from transformers' printed ``Llama4Config`` of
# the hub checkpoint (public "Llama 4 Scout" model notes); the ``moe_layers`` / ``no_rope_layers`` lists
# are as printed ("0..47" expanded). The -Instruct repo differs (10M positions, rope factor 16).
LLAMA4_SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "boi_token_index": 200080,
    "eoi_token_index": 200081,
    "image_token_index": 200092,
    "model_type": "llama4",
    "text_config": {
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": 4,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "floor_scale": 8192,
        "for_llm_compressor": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 262144,
        "model_type": "llama4_text",
        "moe_layers": list(range(48)),
        "no_rope_layers": [1, 1, 1, 0] * 12,
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 202048,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.51.0",
    "vision_config": {
        "attention_dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_size": 1408,
        "image_size": 336,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "model_type": "llama4_vision_model",
        "multi_modal_projector_bias": False,
        "norm_eps": 1e-05,
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 34,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 4096,
        "projector_output_dim": 4096,
        "rope_theta": 10000,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "vision_output_dim": 4096,
    },
}

# google/gemma-3-27b-it config.json (multimodal; the text fields not listed take Gemma3TextConfig's
# defaults: sliding_window_pattern 6, rope_theta 1e6, rope_local_base_freq 1e4, 131072 positions).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

# mistralai/Mistral-7B-v0.1 config.json.
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

# mistralai/Mamba-Codestral-7B-v0.1 config.json (as converted for transformers; "_name_or_path" dropped).
MAMBA_CODESTRAL_7B = {
    "architectures": ["Mamba2ForCausalLM"],
    "bos_token_id": 0,
    "chunk_size": 256,
    "conv_kernel": 4,
    "eos_token_id": 0,
    "expand": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.1,
    "intermediate_size": 8192,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba2",
    "n_groups": 8,
    "norm_before_gate": True,
    "num_heads": 128,
    "num_hidden_layers": 64,
    "pad_token_id": 0,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "rms_norm": True,
    "state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_init_scheme": "random",
    "time_step_limit": [0.0, math.inf],
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 256,
    "time_step_scale": 1.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 32768,
}

# nvidia/Nemotron-H-8B-Base-8K config.json, as mirrored by Megatron-Bridge's conversion tests
# (``auto_map`` kept; any hub keys that mirror omits take NemotronHConfig defaults).
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "auto_map": {
        "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
    },
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "hidden_act": "relu2",
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# ibm-ai-platform/Bamba-9B. RECONSTRUCTED (no verbatim copy found offline) from the facts public
# sources agree on: 32 layers, attention at [9, 18, 27], hidden 4096, 32 heads / 8 KV heads,
# Mamba2 with 128 heads x 64, state 128, 1 group; other keys as in the HF conversion.
BAMBA_9B = {
    "architectures": ["BambaForCausalLM"],
    "attention_dropout": 0.0,
    "attn_layer_indices": [9, 18, 27],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "model_type": "bamba",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# openai/gpt-oss-120b config.json, https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json: 36 layers
# alternating sliding (window 128) and full attention, 128 experts top-4, YaRN (factor 32 over 4096 positions,
# theta 150000), MXFP4 experts (the quantization_config); no dtype field (its unquantized tensors are bf16).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

# openai/gpt-oss-20b config.json, https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json: the 120b's
# fields but 24 layers (12 x [sliding, full]) and 32 experts.
GPT_OSS_20B = {**GPT_OSS_120B, "layer_types": ["sliding_attention", "full_attention"] * 12, "num_hidden_layers": 24,
               "num_local_experts": 32}

# LiquidAI/LFM2-1.2B config.json (https://huggingface.co/LiquidAI/LFM2-1.2B/raw/main/config.json), the 4.54-era
# hub spelling: ``block_ff_dim`` (12288, which the SwiGLU width rule turns into 8192) and ``full_attn_idxs``, no
# ``layer_types``. Copied from public ports' test fixtures that quote it verbatim (one adds ``intermediate_size``
# and ``head_dim`` for its own runtime, left out here); its ``transformers_version`` entry is left out.
LFM2_1_2B = {
    "architectures": ["Lfm2ForCausalLM"],
    "block_auto_adjust_ff_dim": True,
    "block_dim": 2048,
    "block_ff_dim": 12288,
    "block_ffn_dim_multiplier": 1.0,
    "block_mlp_init_scale": 1.0,
    "block_multiple_of": 256,
    "block_norm_eps": 1e-05,
    "block_out_init_scale": 1.0,
    "block_use_swiglu": True,
    "block_use_xavier_init": True,
    "bos_token_id": 1,
    "conv_L_cache": 3,
    "conv_bias": False,
    "conv_dim": 2048,
    "conv_dim_out": 2048,
    "conv_use_xavier_init": True,
    "eos_token_id": 7,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "max_position_embeddings": 128000,
    "model_type": "lfm2",
    "norm_eps": 1e-05,
    "num_attention_heads": 32,
    "num_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_pos_enc": True,
    "vocab_size": 65536,
}

# LiquidAI/LFM2-8B-A1B. RECONSTRUCTED (no verbatim copy found offline) from the facts public ports and audits of
# https://huggingface.co/LiquidAI/LFM2-8B-A1B/raw/main/config.json agree on: 24 layers, full attention at
# [2, 6, 10, 14, 18, 21] (``layer_types``) and short convs (width 3, no bias) elsewhere, hidden 2048, 32 heads / 8 KV
# heads, 2 dense layers of 7168, then 32 experts of 1792 top-4 (sigmoid, expert bias, renormalised), 128000
# positions, the legacy top-level ``rope_theta`` 1e6, tied embeddings, vocab 65536, eos 7, bf16.
LFM2_8B_A1B = {
    "architectures": ["Lfm2MoeForCausalLM"],
    "bos_token_id": 1,
    "conv_L_cache": 3,
    "conv_bias": False,
    "eos_token_id": 7,
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                    "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                    "full_attention", "conv", "conv", "full_attention", "conv", "conv"],
    "max_position_embeddings": 128000,
    "model_type": "lfm2_moe",
    "moe_intermediate_size": 1792,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_dense_layers": 2,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_theta": 1000000.0,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_expert_bias": True,
    "vocab_size": 65536,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct (https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/raw/main/config.json; the
# -Thinking repo has the same architecture). PARTLY RECONSTRUCTED: the keys from ``architectures`` to
# ``moe_intermediate_size`` as a public copy of that file shows them; the rest from the model card's facts (48 layers,
# hybrid layout 12 x (3 Gated DeltaNet + 1 gated attention), attention 16 q / 2 kv heads of 256 with a 64-dim rotary
# embedding (partial_rotary_factor 0.25), Gated DeltaNet 16 q/k heads / 32 v heads of 128, 512 experts of 512 with 10
# routed + 1 shared, 262144 native positions) and the Qwen3 tokenizer's ids / vocabulary; rope_theta 1e7 and eps
# 1e-6 as the public ports read them (neither changes a plan).
QWEN3_NEXT_80B_A3B = {
    "architectures": ['Qwen3NextForCausalLM'],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": 'silu',
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": 'qwen3_next',
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": 'bfloat16',
    "use_cache": True,
    "vocab_size": 151936,
}

# CohereLabs/c4ai-command-r7b-12-2024 (https://huggingface.co/CohereLabs/c4ai-command-r7b-12-2024/raw/main/config.json).
# RECONSTRUCTED (no verbatim copy found offline): 32 layers, 32 heads / 8 KV heads of 128 (hidden 4096), sliding window
# 4096 with every 4th layer global (``sliding_window_pattern`` 4) and 132096 positions as public config audits quote
# them; intermediate 14336, vocab 256000, rope_theta 50000, logit_scale 0.25, LayerNorm eps 1e-5, tied embeddings,
# bos 5 / eos 255001 / pad 0 and bf16 from the model card and transformers' Cohere2 docs and defaults. Keys the
# converter does not read (Cohere's own ``use_qk_norm``, ``position_embedding_type``, ...) are left out.
COMMAND_R7B = {
    "architectures": ["Cohere2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 5,
    "eos_token_id": 255001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "layer_norm_eps": 1e-05,
    "logit_scale": 0.25,
    "max_position_embeddings": 132096,
    "model_type": "cohere2",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_theta": 50000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 256000,
}

# LGAI-EXAONE/EXAONE-4.0-32B (https://huggingface.co/LGAI-EXAONE/EXAONE-4.0-32B/raw/main/config.json). RECONSTRUCTED
# (no verbatim copy found offline): 64 layers repeating "LLLG" (3 sliding of window 4096, 1 global NoPE), hidden 5120,
# 40 heads / 8 KV heads of 128, untied head, bf16 as public config audits quote them; intermediate 27392, vocab
# 102400, 131072 positions, llama3 RoPE (factor 16 over 8192, theta 1e6) and RMS eps 1e-5 from the model card and
# public ports. ``layer_types`` is written out (transformers 5.x reads it; it cannot expand the string pattern); the
# special token ids are left out (planning does not read them).
EXAONE4_32B = {
    "architectures": ["Exaone4ForCausalLM"],
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 27392,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 16,
    "max_position_embeddings": 131072,
    "model_type": "exaone4",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": "LLLG",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 102400,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct. Reconstructed without the hub: the sizes are transformers 5.24's
# ``KimiLinearConfig`` defaults (whose docstring names this checkpoint); the 1-indexed layer lists and the remaining
# keys (mla_use_nope, the router activation, first_k_dense_replace, dtype, ...) as several public repositories quote
# the released config.json verbatim, all alike. ``_source`` in the bundled file says which key came from where.
KIMI_LINEAR_48B_A3B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "attention_bias": False,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "model_max_length": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "_source": {
        "transformers 5.24 KimiLinearConfig defaults (configuration_kimi_linear.py; its docstring names this "
        "checkpoint), equal to the released config.json":
            "vocab_size, hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers, "
            "num_attention_heads, num_key_value_heads, kv_lora_rank, q_lora_rank, qk_nope_head_dim, "
            "qk_rope_head_dim, v_head_dim, attention_bias, num_experts, num_experts_per_token, "
            "num_shared_experts, moe_renormalize, routed_scaling_factor, num_expert_group, topk_group, "
            "hidden_act, rms_norm_eps, model_max_length, bos_token_id, eos_token_id, pad_token_id, "
            "tie_word_embeddings, use_cache, linear_attn_config.head_dim (HF: linear_head_dim), "
            "linear_attn_config.num_heads (HF: linear_num_heads), linear_attn_config.short_conv_kernel_size "
            "(HF: linear_conv_kernel_dim)",
        "the released config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as quoted verbatim by several "
        "public repositories (the hub itself was not read)":
            "architectures, model_type, head_dim (unused: HF sets head_dim = qk_rope_head_dim), mla_use_nope, "
            "linear_attn_config.full_attn_layers, kda_layers (1-indexed; HF's own default would put full "
            "attention on 0-indexed layers 4, 8, ..., 24 instead), moe_router_activation_func, "
            "use_grouped_topk, first_k_dense_replace, moe_layer_freq (HF ignores it), num_nextn_predict_layers,"
            " rope_theta (unused: MLA is NoPE), torch_dtype",
    },
}


# Qwen/Qwen3.5-35B-A3B (https://huggingface.co/Qwen/Qwen3.5-35B-A3B/raw/main/config.json). RECONSTRUCTED (no copy of
# the file offline): the text part's sizes are transformers' ``Qwen3_5MoeTextConfig`` defaults, which its docs name as
# the Qwen3.5-35B-A3B configuration, and match the model card (40 layers, 10 x (3 Gated DeltaNet + 1 gated attention),
# hidden 2048, vocabulary 248320 (padded), DeltaNet 16 q/k heads / 32 v heads of 128, attention 16 q / 2 kv heads of
# 256 with a 64-dim rotary embedding, 256 experts of 512 with 8 routed + 1 shared, 262144 native positions); the
# multimodal RoPE sections [11, 11, 10] are HF's default; rope_theta 1e7 as Qwen3-Next (it does not change a plan).
# The vision tower's sizes are ``Qwen3_5MoeVisionConfig``'s defaults (out_hidden_size set to the text width its merger
# feeds) and the vision token ids ``Qwen3_5MoeConfig``'s; the multi-token-prediction keys and the text special token
# ids are left out (neither is read here).
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "video_token_id": 248057,
    "vision_config": {
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_moe_vision",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

# allenai/Olmo-Hybrid-7B (https://huggingface.co/allenai/Olmo-Hybrid-7B/raw/main/config.json). RECONSTRUCTED (no copy
# of the file offline): transformers' ``OlmoHybridConfig`` defaults, which its docs name as the allenai/Olmo-Hybrid-7B
# configuration: 32 layers with full attention on every 4th (3, 7, ..., 31; HF's default ``layer_types``), hidden
# 3840, intermediate 11008, 30 heads (kv heads default to them, head dim 128), DeltaNet 30 key / 30 value heads of 96 /
# 192 (HF's derived defaults: 0.75 x hidden / heads, twice that), conv 4, negative eigenvalues allowed, vocabulary
# 100352 (eos 100257, pad 100277: the OLMo tokenizer's), 65536 positions, RMS eps 1e-6; bf16 assumed as every OLMo
# release. The RoPE theta is not known here: the key is left out, so the config reads HF's default 10000 (it does not
# change a plan; a released null theta would make the attention NoPE, which the converter reads too).
OLMO_HYBRID_7B = {
    "architectures": ["OlmoHybridForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 3840,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8,
    "linear_allow_neg_eigval": True,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 96,
    "linear_num_key_heads": 30,
    "linear_num_value_heads": 30,
    "linear_value_head_dim": 192,
    "max_position_embeddings": 65536,
    "model_type": "olmo_hybrid",
    "num_attention_heads": 30,
    "num_hidden_layers": 32,
    "num_key_value_heads": 30,
    "pad_token_id": 100277,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}


# google/gemma-4-E4B-it: the text decoder of the multimodal checkpoint (vision / audio configs left out).
# RECONSTRUCTED without the hub file; each number's source is in its ``_source`` entry (NVIDIA Megatron-Bridge's
# Gemma 4 E4B recipe, google/gemma.cpp's Gemma 4 configs, transformers 5.24's Gemma4TextConfig defaults).
GEMMA4_E4B = {
    "_source": {
        "model":
            ("google/gemma-4-E4B-it (text decoder; vision and audio configs left out: hybridkv reads only "
             "text_config)"),
        ("text_config.num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, "
         "num_key_value_heads, global_head_dim, layer_types (5 sliding : 1 global), rope_parameters, "
         "hidden_size_per_layer_input, vocab_size_per_layer_input, num_kv_shared_layers"):
            ("NVIDIA Megatron-Bridge API docs, bridge.recipes.gemma.h100.gemma4 (Gemma 4 E4B: 42 layers, hidden "
             "2560, FFN 10240, 8 heads, 2 KV heads sliding and global with head_dim 512, skip_freq 6, sliding "
             "theta 1e4 / global theta 1e6 with 0.25 partial rotation, PLE vocab 262144 dim 256, KV shared across "
             "the last 18 layers)"),
        ("text_config.head_dim, sliding_window, final_logit_softcapping, vocab_size; uniform FFN "
         "(use_double_wide_mlp false)"):
            ("google/gemma.cpp pull request 919, 'Add Gemma 4 E2B and E4B model configs' (qkv_dim 256 sliding / "
             "512 global, SWA window 512, final_cap 30.0, vocab 262144, E4B uniform FFN 10240)"),
        "text_config.max_position_embeddings":
            ("transformers 5.24 Gemma4TextConfig default 131072; Google's Gemma 4 overview: the small models have "
             "a 128K context window"),
        "text_config.attention_k_eq_v, rms_norm_eps, hidden_activation, bos/eos/pad ids, tie_word_embeddings":
            ("transformers 5.24 Gemma4TextConfig defaults (global KV heads equal num_key_value_heads, so no k_eq_v"
             " override)"),
        "dtype":
            "bfloat16, the precision Gemma checkpoints are released in (Gemma 4 docs: default 16-bit precision)",
    },
    "architectures": [
        "Gemma4ForConditionalGeneration"
    ],
    "dtype": "bfloat16",
    "model_type": "gemma4",
    "text_config": {
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2560,
        "hidden_size_per_layer_input": 256,
        "intermediate_size": 10240,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
        "max_position_embeddings": 131072,
        "model_type": "gemma4_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 42,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 18,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional"
            },
            "sliding_attention": {
                "rope_theta": 10000.0,
                "rope_type": "default"
            }
        },
        "sliding_window": 512,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144
    },
    "tie_word_embeddings": True
}

# google/gemma-3n-E4B-it: the text decoder of the multimodal checkpoint (vision / audio configs left out).
# RECONSTRUCTED without the hub file, from transformers 5.24's Gemma3nTextConfig, whose defaults are documented as
# the E4B configuration; each number's source is in its ``_source`` entry.
GEMMA3N_E4B = {
    "_source": {
        "model":
            ("google/gemma-3n-E4B-it (text decoder; vision and audio configs left out: hybridkv reads only "
             "text_config)"),
        ("text_config.vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
         "num_key_value_heads, head_dim, sliding_window, layer_types (4 sliding : 1 global), rope_parameters, "
         "final_logit_softcapping, vocab_size_per_layer_input, hidden_size_per_layer_input, altup_*, laurel_rank, "
         "num_kv_shared_layers, activation_sparsity_pattern, rms_norm_eps, hidden_activation"):
            ("transformers 5.24 Gemma3nTextConfig defaults (configuration_gemma3n.py: @auto_docstring(checkpoint="
             "'google/gemma-3n-E4B'); its docstring: 'Initializing a Gemma3nText gemma3n_text-E4B style "
             "configuration' with Gemma3nTextConfig(); the instruction-tuned -it checkpoint shares the base "
             "model's architecture). layer_types and activation_sparsity_pattern are what its __post_init__ "
             "expands the defaults to (every 5th layer global; 0.95 on the first 10 of 35 layers)"),
        "text_config.max_position_embeddings":
            ("transformers 5.24 Gemma3nTextConfig default 32768; Google's Gemma 3n model card: a total input "
             "context of 32K tokens"),
        "dtype":
            "bfloat16, the precision Gemma checkpoints are released in",
    },
    "architectures": [
        "Gemma3nForConditionalGeneration"
    ],
    "dtype": "bfloat16",
    "model_type": "gemma3n",
    "text_config": {
        "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 25,
        "altup_active_idx": 0,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_num_inputs": 4,
        "attention_bias": False,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2048,
        "hidden_size_per_layer_input": 256,
        "intermediate_size": [16384] * 35,
        "laurel_rank": 64,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "max_position_embeddings": 32768,
        "model_type": "gemma3n_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 35,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 15,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {
                "rope_theta": 1000000.0,
                "rope_type": "default"
            },
            "sliding_attention": {
                "rope_theta": 10000.0,
                "rope_type": "default"
            }
        },
        "sliding_window": 512,
        "vocab_size": 262400,
        "vocab_size_per_layer_input": 262144
    },
    "tie_word_embeddings": True
}

# bundled name (hybridkv/configs/<name>.json) -> config
RELEASED = {
    "command-r7b": COMMAND_R7B,
    "exaone4-32b": EXAONE4_32B,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    "llama4-scout": LLAMA4_SCOUT,
    "gemma3-27b": GEMMA3_27B,
    "gemma4-e4b": GEMMA4_E4B,
    "gemma3n-e4b": GEMMA3N_E4B,
    "mistral-7b-v0.1": MISTRAL_7B,
    "mamba-codestral-7b": MAMBA_CODESTRAL_7B,
    "nemotron-h-8b": NEMOTRON_H_8B,
    "bamba-9b": BAMBA_9B,
    "lfm2-1.2b": LFM2_1_2B,
    "lfm2-8b-a1b": LFM2_8B_A1B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "olmo-hybrid-7b": OLMO_HYBRID_7B,
}

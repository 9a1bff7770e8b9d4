"""HF config -> HybridConfig for every supported family, checked against transformers itself.

For each family a tiny HF config is built three ways and must agree:
1. the raw kwargs (what a sparse config.json holds; our converter fills HF's class defaults),
2. ``XxxConfig(**kwargs).to_dict()`` (HF's own post-init values, 5.x RoPE spelling),
3. the HF model instantiated on the meta device: which layers hold attention (and which window or
   chunk their mask uses), Mamba, MLP or MoE is read off HF's modules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridkv.loaders import hf_config_to_hybrid, load_config, supported_architectures  # noqa: E402
from hybridkv.models.config import MLP, Attention, HybridConfig, Mamba1, Mamba2, MoE  # noqa: E402

HF_KWARGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama4": ("Llama4TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8,
        interleave_moe_layer_step=2, num_local_experts=4, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    "mamba2": ("Mamba2Config", dict(
        vocab_size=128, hidden_size=32, expand=2, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        num_hidden_layers=3, chunk_size=8)),
    "mistral": ("MistralConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=64)),
    "gemma2": ("Gemma2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=100.0)),
    "bamba": ("BambaConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_state=8,
        mamba_chunk_size=16)),
    "jamba": ("JambaConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8)),
    "zamba2": ("Zamba2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, n_mamba_heads=4,
        mamba_d_state=8, num_hidden_layers=6, layers_block_type=["mamba", "hybrid"] * 3,
        num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True)),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=128, hidden_size=64, hybrid_override_pattern="M*M-ME", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, chunk_size=16)),
    "falcon_h1": ("FalconH1Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_state=8, mamba_rms_norm=True,
        key_multiplier=0.5, mlp_multipliers=[0.5, 2.0], ssm_multipliers=[1.0, 2.0, 3.0, 4.0, 5.0],
        embedding_multiplier=3.0, lm_head_multiplier=0.25)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=4,
        mamba_d_state=8, num_local_experts=4, shared_intermediate_size=64, attention_multiplier=0.25,
        logits_scaling=4.0, embedding_multiplier=12.0, residual_multiplier=0.22,
        position_embedding_type="nope")),
    "gpt_oss": ("GptOssConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "lfm2": ("Lfm2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, full_attn_idxs=[1, 4], conv_L_cache=4, conv_bias=True)),
    "lfm2_moe": ("Lfm2MoeConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv",
                                                                    "full_attention"], num_dense_layers=2,
        num_experts=4, num_experts_per_tok=2)),
    "qwen3_next": ("Qwen3NextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, full_attention_interval=3, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[2])),
    "kimi_linear": ("KimiLinearConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        linear_num_heads=2, linear_head_dim=16, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_group=2, topk_group=1, norm_topk_prob=False, max_position_embeddings=2048, first_k_dense_replace=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, full_attention_interval=3, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None, eos_token_id=None)),
    "cohere2": ("Cohere2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, sliding_window_pattern=3, logit_scale=0.25, attention_bias=True,
        rope_theta=500.0)),
    "exaone4": ("Exaone4Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=4,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, rope_theta=1000.0)),
    "granite_swa": ("GraniteSWAConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, layer_rope_theta=[0, 100.0, 100.0, 0, 5000.0, 5000.0],
        attention_multiplier=0.25, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=4.0,
        mlp_bias=True)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, layer_rope_theta=[0, 100.0, 100.0, 0, 5000.0, 5000.0],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, attention_multiplier=0.25,
        embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=4.0, attention_bias=True)),
    "gemma4": ("Gemma4TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=8, layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention", "sliding_attention", "full_attention"], num_kv_shared_layers=3,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, use_double_wide_mlp=True)),
    "gemma3n": ("Gemma3nTextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=[128, 96, 128, 128, 64, 128], num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, activation_sparsity_pattern=[0.95] + [0.0] * 5,
        altup_num_inputs=3, laurel_rank=8)),
}
MODEL_TYPE = {"llama4": "llama4_text", "gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma3n": "gemma3n_text"}


def hf_config(family: str) -> Any:
    cls_name, kwargs = HF_KWARGS[family]
    return getattr(transformers, cls_name)(**kwargs)


def raw_config(family: str) -> dict[str, Any]:
    return {"model_type": MODEL_TYPE.get(family, family), **HF_KWARGS[family][1]}


def hf_model(config: Any) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


# -- what HF builds, per layer: (mixer kind, feed-forward kind) ---------------------------------------------
Kinds = list[tuple[str | None, str | None]]


def _layers(model: Any) -> Any:
    if hasattr(model, "layers"):
        return model.layers
    return (getattr(model, "model", None) or model.backbone).layers


def _hf_llama4(model: Any, cfg: Any) -> Kinds:
    kinds = {"chunked_attention": "chunked_local", "full_attention": "full"}
    return [(kinds[cfg.layer_types[i]], "moe" if layer.is_moe_layer else "mlp")
            for i, layer in enumerate(_layers(model))]


def _hf_gemma(model: Any, cfg: Any) -> Kinds:
    return [("sliding_window" if layer.self_attn.sliding_window else "full", "mlp")
            for layer in _layers(model)]


def _hf_mistral(model: Any, cfg: Any) -> Kinds:
    return [("sliding_window" if cfg.sliding_window else "full", "mlp") for _ in _layers(model)]


def _hf_block_type(mixer: dict[str, str | None], ffn: dict[str, str | None]) -> Callable[[Any, Any], Kinds]:
    def kinds(model: Any, cfg: Any) -> Kinds:
        return [(mixer[layer.block_type], ffn[layer.block_type]) for layer in _layers(model)]
    return kinds


def _hf_jamba(model: Any, cfg: Any) -> Kinds:
    return [("full" if hasattr(layer, "self_attn") else "mamba1",
             "moe" if "Sparse" in type(layer.feed_forward).__name__ else "mlp") for layer in _layers(model)]


def _hf_zamba2(model: Any, cfg: Any) -> Kinds:
    return [("mamba2", "shared" if hasattr(layer, "shared_transformer") else None)
            for layer in _layers(model)]


def _hf_granite(model: Any, cfg: Any) -> Kinds:
    return [("full" if layer.self_attn is not None else "mamba2", "moe" if layer.has_experts else "mlp")
            for layer in _layers(model)]


HF_KINDS: dict[str, Callable[[Any, Any], Kinds]] = {
    "llama4": _hf_llama4,
    "mamba2": lambda model, cfg: [("mamba2", None) for _ in _layers(model)],
    "mistral": _hf_mistral,
    "gemma2": _hf_gemma,
    "gemma3": _hf_gemma,
    "bamba": _hf_block_type({"linear_attention": "mamba2", "full_attention": "full"},
                            {"linear_attention": "mlp", "full_attention": "mlp"}),
    "jamba": _hf_jamba,
    "zamba2": _hf_zamba2,
    "nemotron_h": _hf_block_type(
        {"linear_attention": "mamba2", "full_attention": "full", "mlp": None, "moe": None},
        {"linear_attention": None, "full_attention": None, "mlp": "mlp", "moe": "moe"}),
    "falcon_h1": lambda model, cfg: [("full", "mlp") for _ in _layers(model)],
    "granitemoehybrid": _hf_granite,
    "gpt_oss": lambda model, cfg: [("sliding_window" if layer.self_attn.sliding_window else "full", "moe")
                                   for layer in _layers(model)],
    "cohere2": _hf_gemma,
    "exaone4": lambda model, cfg: [("sliding_window" if layer.self_attn.is_sliding else "full", "mlp")
                                   for layer in _layers(model)],
    "granite_swa": _hf_gemma,
    "granitemoe_swa": lambda model, cfg: [("sliding_window" if layer.self_attn.sliding_window else "full", "moe")
                                          for layer in _layers(model)],
    "gemma4": _hf_gemma,
    "gemma3n": _hf_gemma,
    "lfm2": lambda model, cfg: [("full" if layer.is_attention_layer else "short_conv", "mlp")
                                for layer in _layers(model)],
    "lfm2_moe": lambda model, cfg: [("full" if layer.is_attention_layer else "short_conv",
                                     "moe" if hasattr(layer.feed_forward, "experts") else "mlp")
                                    for layer in _layers(model)],
    "qwen3_next": lambda model, cfg: [("full" if layer.block_type == "full_attention" else "gated_deltanet",
                                       "moe" if hasattr(layer.mlp, "experts") else "mlp")
                                      for layer in _layers(model)],
    "kimi_linear": lambda model, cfg: [("full" if layer.block_type == "full_attention" else "kda",
                                        "moe" if hasattr(layer.mlp, "experts") else "mlp")
                                       for layer in _layers(model)],
    "qwen3_5_text": lambda model, cfg: [("full" if layer.block_type == "full_attention" else "gated_deltanet", "mlp")
                                        for layer in _layers(model)],
    "qwen3_5_moe_text": lambda model, cfg: [("full" if layer.block_type == "full_attention" else "gated_deltanet",
                                             "moe" if hasattr(layer.mlp, "experts") else "mlp")
                                            for layer in _layers(model)],
    "olmo_hybrid": lambda model, cfg: [("full" if hasattr(layer, "self_attn") else "gated_deltanet", "mlp")
                                       for layer in _layers(model)],
}


def our_kinds(config: HybridConfig) -> Kinds:
    out: Kinds = []
    for layer in config.layers:
        ffn = {MLP: "mlp", MoE: "moe"}.get(type(layer.ffn)) if layer.ffn else None
        out.append((layer.mixer.kind if layer.mixer else None, "shared" if layer.shared_block else ffn))
    return out


@pytest.mark.parametrize("family", sorted(HF_KWARGS))
def test_layer_kinds_match_hf_modules(family: str) -> None:
    cfg = hf_config(family)
    ours = hf_config_to_hybrid(cfg.to_dict())
    assert our_kinds(ours) == HF_KINDS[family](hf_model(cfg), cfg)


@pytest.mark.parametrize("family", sorted(HF_KWARGS))
def test_raw_kwargs_and_hf_to_dict_agree(family: str) -> None:
    """Our defaults for keys a config.json omits are HF's class defaults."""
    assert hf_config_to_hybrid(raw_config(family)) == hf_config_to_hybrid(hf_config(family).to_dict())


@pytest.mark.parametrize("family", sorted(HF_KWARGS))
def test_round_trip(family: str, tmp_path: Any) -> None:
    config = hf_config_to_hybrid(hf_config(family).to_dict())
    assert HybridConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "config.json"
    config.save(path)
    assert HybridConfig.load(path) == config
    assert load_config(path) == config               # native configs load through the same entry point


def test_every_supported_architecture_is_tested() -> None:
    from hybridkv.loaders.hf_config import MODEL_TYPES

    tested = {MODEL_TYPES[MODEL_TYPE.get(f, f)] for f in HF_KWARGS}
    tested |= {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}  # test_parity_qwen3_5
    tested |= {"Llama4ForConditionalGeneration", "Gemma3ForConditionalGeneration",  # test_multimodal_*
               "Gemma4ForConditionalGeneration",                                     # test_parity_gemma4
               "Gemma3nForConditionalGeneration"}                                    # test_parity_gemma3n
    assert tested == set(supported_architectures())


# -- family details ------------------------------------------------------------------------------------------
def test_llama4_rope_qk_norm_and_temperature_tuning_follow_hf_modules() -> None:
    cfg = hf_config("llama4")
    ours = hf_config_to_hybrid(cfg.to_dict())
    for layer, hf_layer in zip(ours.layers, _layers(hf_model(cfg)), strict=True):
        attn = layer.mixer
        assert isinstance(attn, Attention)
        assert (attn.rope is not None) == bool(hf_layer.self_attn.use_rope)
        assert (attn.qk_norm == "rms_weightless") == hasattr(hf_layer.self_attn, "qk_norm")
        assert (attn.temperature_tuning == (0.1, 8192.0)) == (not hf_layer.self_attn.use_rope)
        assert attn.attention_chunk_size in (None, 8)
    rope = ours.layers[0].mixer.rope
    assert rope is not None and rope.interleaved and rope.scaling == "llama3" and rope.factor == 8.0
    moe = ours.layers[1].ffn
    assert isinstance(moe, MoE) and moe.router == "sigmoid_input" and moe.shared_intermediate_size == 32
    assert ours.layers[0].ffn == MLP(intermediate_size=64)


def test_llama4_accepts_int_temperature_tuning_and_nope_interval_spelling() -> None:
    raw = raw_config("llama4") | {"attn_temperature_tuning": 4, "nope_layer_interval": 2,
                                   "no_rope_layer_interval": None}
    ours = hf_config_to_hybrid(raw)
    assert [layer.mixer.kind for layer in ours.layers] == ["chunked_local", "full"] * 4
    assert ours.layers[1].mixer.temperature_tuning == (0.1, 8192.0)
    off = hf_config_to_hybrid(raw | {"attn_temperature_tuning": 0})
    assert off.layers[1].mixer.temperature_tuning is None


def test_multimodal_llama4_uses_the_text_config() -> None:
    text = HF_KWARGS["llama4"][1]
    multi = transformers.Llama4Config(text_config=text).to_dict()
    ours = hf_config_to_hybrid(multi)
    assert ours.architecture == "Llama4ForConditionalGeneration"
    assert ours.layers == hf_config_to_hybrid(raw_config("llama4")).layers


def test_multimodal_gemma3_uses_the_text_config() -> None:
    text = HF_KWARGS["gemma3"][1]
    cfg = transformers.Gemma3Config(text_config=text)
    ours = hf_config_to_hybrid(cfg.to_dict())
    assert ours.architecture == "Gemma3ForConditionalGeneration"
    assert our_kinds(ours) == _hf_gemma(hf_model(cfg).model.language_model, None)
    assert ours.layers == hf_config_to_hybrid(raw_config("gemma3")).layers


def test_gemma3_local_and_global_rope_norms_and_scales() -> None:
    ours = hf_config_to_hybrid(raw_config("gemma3"))
    local, glob = ours.layers[0].mixer, ours.layers[2].mixer
    assert (local.kind, glob.kind) == ("sliding_window", "full")
    assert local.rope.theta == 100.0 and local.rope.scaling is None
    assert glob.rope.theta == 1_000_000.0 and (glob.rope.scaling, glob.rope.factor) == ("linear", 8.0)
    assert local.qk_norm == "rms" and local.scale == 256 ** -0.5 and local.softcap is None
    assert ours.norm == "gemma_rms" and ours.layers[0].sandwich_norm
    assert ours.embedding_multiplier == 64 ** 0.5 and ours.tie_word_embeddings
    assert ours.layers[0].ffn.activation == "gelu_tanh"


def test_gemma2_softcaps() -> None:
    ours = hf_config_to_hybrid(raw_config("gemma2"))
    assert ours.final_softcap == 30.0 and ours.layers[0].mixer.softcap == 50.0
    assert ours.layers[0].mixer.scale == 16 ** -0.5 and ours.layers[0].mixer.qk_norm is None


def test_mistral_without_window_is_full_attention() -> None:
    ours = hf_config_to_hybrid(raw_config("mistral") | {"sliding_window": None})
    assert {layer.mixer.kind for layer in ours.layers} == {"full"}


def test_mamba2_fields() -> None:
    ours = hf_config_to_hybrid(raw_config("mamba2"))
    mixer = ours.layers[0].mixer
    assert mixer == Mamba2(num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8)
    assert ours.residual_in_fp32 and ours.layers[0].ffn is None


def test_bamba_half_rotary_and_jamba_mamba1() -> None:
    bamba = hf_config_to_hybrid(raw_config("bamba"))
    assert bamba.layers[1].mixer.rope.partial_rotary_factor == 0.5
    jamba = hf_config_to_hybrid(raw_config("jamba"))
    assert jamba.layers[1].mixer.rope is None
    assert jamba.layers[0].mixer == Mamba1(intermediate_size=128, state_size=8, dt_rank=4, dt_norm=True)
    moe = jamba.layers[1].ffn
    assert isinstance(moe, MoE) and moe.router == "softmax" and not moe.renormalize


def test_zamba2_shared_blocks() -> None:
    cfg = hf_config("zamba2")
    ours = hf_config_to_hybrid(cfg.to_dict())
    blocks = [layer.shared_block for layer in ours.layers if layer.shared_block]
    assert [(b.block_id, b.use_index) for b in blocks] == [(0, 0), (1, 1), (0, 2)]
    hf_blocks = [layer.shared_transformer.block_id for layer in _layers(hf_model(cfg))
                 if hasattr(layer, "shared_transformer")]
    assert [b.block_id for b in blocks] == hf_blocks
    attn = blocks[0].attention
    assert (attn.head_dim, attn.scale, attn.shared_id) == (32, 16 ** -0.5, 0)
    assert blocks[0].attention_adapters and blocks[0].adapter_rank == 4 and blocks[0].concat_embeddings
    specs = ours.kv_specs()
    assert [n for n in specs if n.endswith(".shared")] == [f"layers.{i}.shared" for i in (1, 3, 5)]
    assert ours.layers[0].mixer.time_step_limit == (0.001, math.inf)


def test_nemotron_h_moe_and_mlp() -> None:
    ours = hf_config_to_hybrid(raw_config("nemotron_h"))
    mlp, moe = ours.layers[3].ffn, ours.layers[5].ffn
    assert mlp == MLP(intermediate_size=128, activation="relu2", gated=False)
    assert isinstance(moe, MoE) and (moe.router, moe.gated, moe.shared_intermediate_size) == (
        "sigmoid_bias", False, 32)
    assert ours.layers[1].mixer.rope is None and ours.layers[1].mixer.head_dim == 16


def test_falcon_h1_parallel_mixers_and_multipliers() -> None:
    ours = hf_config_to_hybrid(raw_config("falcon_h1"))
    layer = ours.layers[0]
    assert isinstance(layer.mixer, Attention) and isinstance(layer.parallel_mixer, Mamba2)
    assert layer.mixer.key_multiplier == 0.5 and layer.mixer.head_dim == 16
    assert layer.parallel_mixer.zxbcdt_multipliers == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert layer.parallel_mixer.gated_norm and layer.parallel_mixer.norm_before_gate
    assert (layer.ffn.gate_multiplier, layer.ffn.down_multiplier) == (0.5, 2.0)
    assert (ours.embedding_multiplier, ours.logits_multiplier) == (3.0, 0.25)
    assert list(ours.kv_specs()) == [f"layers.{i}{s}" for i in range(3) for s in ("", ".parallel")]


def test_granite_multipliers_and_nope() -> None:
    ours = hf_config_to_hybrid(raw_config("granitemoehybrid"))
    attn = ours.layers[2].mixer
    assert attn.rope is None and attn.scale == 0.25
    assert (ours.embedding_multiplier, ours.residual_multiplier, ours.logits_multiplier) == (12.0, 0.22, 0.25)
    assert ours.layers[0].ffn.shared_intermediate_size == 64
    dense = hf_config_to_hybrid(raw_config("granitemoehybrid") | {"num_local_experts": 0})
    assert dense.layers[0].ffn == MLP(intermediate_size=64)


def test_cohere2_parallel_block_layer_norm_and_rope_on_sliding_layers_only() -> None:
    """Every third layer global and NoPE (HF applies RoPE only where ``sliding_window`` is set), interleaved
    rotary, head_dim hidden / heads even when ``head_dim`` says otherwise, logit_scale on the logits."""
    ours = hf_config_to_hybrid(raw_config("cohere2") | {"head_dim": 99})
    assert (ours.norm, ours.logits_multiplier, ours.tie_word_embeddings) == ("layer", 0.25, True)
    for i, layer in enumerate(ours.layers):
        attn = layer.mixer
        assert layer.parallel_ffn and not layer.sandwich_norm and attn.head_dim == 16
        assert attn.qkv_bias and attn.o_bias
        if i % 3 == 2:
            assert (attn.kind, attn.rope) == ("full", None)
        else:
            assert attn.sliding_window == 8 and attn.rope.interleaved and attn.rope.theta == 500.0


def test_exaone4_post_norms_qk_norms_and_nope_global_layers() -> None:
    ours = hf_config_to_hybrid(raw_config("exaone4"))
    kinds = [(layer.mixer.kind, layer.mixer.rope is not None) for layer in ours.layers]
    assert kinds == [("sliding_window", True)] * 3 + [("full", False)] + [("sliding_window", True)] * 3 + [
        ("full", False)]
    layer = ours.layers[0]
    assert (layer.pre_norm, layer.sandwich_norm, layer.mixer.qk_norm) == (False, True, "rms")
    assert layer.mixer.rope.scaling == "llama3" and layer.mixer.rope.theta == 1000.0
    # The released configs spell the pattern as a string; an int pattern and the string agree.
    assert hf_config_to_hybrid(raw_config("exaone4") | {"sliding_window_pattern": "LLLG"}) == ours
    # Without a window every layer is global with RoPE (EXAONE-4.0-1.2B).
    full = hf_config_to_hybrid(raw_config("exaone4") | {"sliding_window": None})
    assert all(lay.mixer.kind == "full" and lay.mixer.rope is not None for lay in full.layers)
    with pytest.raises(ValueError, match="sliding_window_pattern 'LLXG'"):
        hf_config_to_hybrid(raw_config("exaone4") | {"sliding_window_pattern": "LLXG"})


def test_granite_swa_sinks_rope_per_layer_and_multipliers() -> None:
    ours = hf_config_to_hybrid(raw_config("granite_swa"))
    attn = [layer.mixer for layer in ours.layers]
    assert [a.kind for a in attn] == ["full"] + ["sliding_window"] * 3 + ["full", "sliding_window"]  # i % 4: global
    assert [a.rope.theta if a.rope else 0 for a in attn] == [0, 100.0, 100.0, 0, 5000.0, 5000.0]
    assert all(a.sinks and a.scale == 0.25 for a in attn)
    assert ours.layers[0].ffn.bias
    assert (ours.embedding_multiplier, ours.residual_multiplier, ours.logits_multiplier) == (12.0, 0.22, 0.25)
    with pytest.raises(ValueError, match="layer_rope_theta has 2 entries for 6 layers"):
        hf_config_to_hybrid(raw_config("granite_swa") | {"layer_rope_theta": [0, 1.0]})


def test_granitemoe_swa_attention_experts_and_multipliers_follow_hf() -> None:
    """Granite-SWA's attention (the same layers from the same keys) over GraniteMoE's experts, each checked against
    HF's modules: sinks and biases, the window, RoPE or NoPE, the experts' and shared MLP's widths; shared experts
    off by default (HF's ``shared_intermediate_size=0`` builds no ``shared_mlp``); multipliers."""
    cfg = hf_config("granitemoe_swa")
    ours = hf_config_to_hybrid(cfg.to_dict())
    swa = hf_config_to_hybrid(raw_config("granite_swa") | {"intermediate_size": 32, "attention_bias": True})
    assert [layer.mixer for layer in ours.layers] == [layer.mixer for layer in swa.layers]
    for layer, hf_layer, theta in zip(ours.layers, _layers(hf_model(cfg)), cfg.layer_rope_theta, strict=True):
        attn, moe, hf_moe = layer.mixer, layer.ffn, hf_layer.block_sparse_moe
        assert attn.sinks and attn.qkv_bias and attn.o_bias and hf_layer.self_attn.q_proj.bias is not None
        assert attn.sliding_window == hf_layer.self_attn.sliding_window and attn.scale == hf_layer.self_attn.scaling
        assert (attn.rope.theta if attn.rope else 0) == theta
        assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (
            hf_moe.experts.num_experts, hf_moe.router.top_k, hf_moe.experts.intermediate_dim)
        assert (moe.router, moe.renormalize, moe.shared_intermediate_size) == ("softmax", True,
                                                                                hf_layer.shared_mlp.hidden_size)
    assert (ours.embedding_multiplier, ours.residual_multiplier, ours.logits_multiplier) == (12.0, 0.22, 0.25)
    off = transformers.GraniteMoeSWAConfig(**(HF_KWARGS["granitemoe_swa"][1] | {"shared_intermediate_size": 0}))
    assert _layers(hf_model(off))[0].shared_mlp is None
    bare = {k: v for k, v in raw_config("granitemoe_swa").items() if k != "shared_intermediate_size"}
    assert {layer.ffn.shared_intermediate_size for layer in hf_config_to_hybrid(bare).layers} == {0}
    with pytest.raises(ValueError, match="layer_rope_theta has 2 entries for 6 layers"):
        hf_config_to_hybrid(raw_config("granitemoe_swa") | {"layer_rope_theta": [0, 1.0]})


def test_gpt_oss_attention_moe_and_yarn_follow_hf() -> None:
    """Sinks and biases on every layer, HF's default YaRN (factor 32 over 4096 positions, theta 150000) when the
    config names none, with HF's own inverse frequencies and attention factor; the experts' constants."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hybridkv.layers.rotary import rope_attention_factor, rope_inv_freq

    cfg = hf_config("gpt_oss")
    ours = hf_config_to_hybrid(cfg.to_dict())
    for layer, hf_layer in zip(ours.layers, _layers(hf_model(cfg)), strict=True):
        attn, moe = layer.mixer, layer.ffn
        assert attn.sinks and attn.qkv_bias and attn.o_bias and hf_layer.self_attn.q_proj.bias is not None
        assert attn.sliding_window == hf_layer.self_attn.sliding_window
        assert (moe.router, moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == (
            "topk_softmax", "swiglu_oai", cfg.swiglu_alpha, cfg.swiglu_limit)
    rope = ours.layers[0].mixer.rope
    assert (rope.scaling, rope.factor, rope.theta, rope.truncate) == ("yarn", 32.0, 150000.0, False)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.equal(rope_inv_freq(rope, 16), inv_freq) and rope_attention_factor(rope) == factor
    assert ours.dtype == "bfloat16"                    # no dtype named: the released checkpoints' bf16
    assert hf_config_to_hybrid(raw_config("gpt_oss") | {"dtype": "float32"}).dtype == "float32"
    custom = hf_config_to_hybrid(raw_config("gpt_oss") | {"layer_types": ["full_attention"] * 5})
    assert all(layer.mixer.sliding_window is None for layer in custom.layers)
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        hf_config_to_hybrid(raw_config("gpt_oss") | {"quantization_config": {"quant_method": "awq"}})
    assert hf_config_to_hybrid(raw_config("gpt_oss") | {"quantization_config": {"quant_method": "mxfp4"}}) == ours


def test_yarn_variants_follow_hf() -> None:
    """truncate, mscale / mscale_all_dim, an explicit attention factor, other betas, against HF's own YaRN on the
    same parameters; a factor left out is the position ratio (HF 5.24's validation requires one)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hybridkv.layers.rotary import rope_attention_factor, rope_inv_freq

    for extra in ({"truncate": True}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"attention_factor": 1.5},
                  {"factor": 16.0, "beta_fast": 16.0}):
        params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                  **extra}
        kwargs = dict(head_dim=16, num_attention_heads=4, hidden_size=64, max_position_embeddings=1024)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(rope_parameters=params, **kwargs), "cpu")
        rope = hf_config_to_hybrid(raw_config("gpt_oss") | kwargs | {"rope_parameters": params}).layers[0].mixer.rope
        assert torch.equal(rope_inv_freq(rope, 16), inv_freq), extra
        assert rope_attention_factor(rope) == pytest.approx(factor, rel=1e-12), extra
    no_factor = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64}
    config = raw_config("gpt_oss") | {"max_position_embeddings": 1024, "rope_parameters": no_factor}
    assert hf_config_to_hybrid(config).layers[0].mixer.rope.factor == 16.0


def test_dtype_defaults_to_checkpoint_dtype() -> None:
    assert hf_config_to_hybrid(raw_config("mistral") | {"torch_dtype": "bfloat16"}).dtype == "bfloat16"
    assert hf_config_to_hybrid(raw_config("mistral") | {"dtype": "float16"}).dtype == "float16"
    assert hf_config_to_hybrid(raw_config("mistral")).dtype == "float32"
    specs = hf_config_to_hybrid(raw_config("nemotron_h") | {"torch_dtype": "bfloat16"}).kv_specs()
    assert specs["layers.1"].dtype == torch.bfloat16
    assert specs["layers.0"].dtypes == (torch.bfloat16, torch.float32)


# -- errors --------------------------------------------------------------------------------------------------
def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="unsupported architecture LlamaForCausalLM.*MistralForCausalLM"):
        hf_config_to_hybrid({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match="model_type='bert'"):
        hf_config_to_hybrid({"model_type": "bert"})


@pytest.mark.parametrize(("family", "change", "match"), [
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention", "swa"] + ["full_attention"] * 4},
     "layer 2 has unknown layer type 'swa'"),
    ("nemotron_h", {"hybrid_override_pattern": "M*X"}, "layer 2 has unknown hybrid_override_pattern char"),
    ("granitemoehybrid", {"layer_types": ["mamba", "conv", "attention", "mamba"]}, "layer 1 has unknown"),
    ("zamba2", {"layers_block_type": ["mamba", "attention"]}, "layer 1 has unknown layer type"),
    ("llama4", {"layer_types": ["chunked_attention"] * 7 + ["sliding"]}, "layer 7 has unknown"),
])
def test_unknown_layer_type_names_the_layer(family: str, change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf_config_to_hybrid(raw_config(family) | change)


def test_unsupported_rope_and_activation_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="RoPE type 'longrope' is not supported"):
        hf_config_to_hybrid(raw_config("mistral") | {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported activation 'tanh'"):
        hf_config_to_hybrid(raw_config("mistral") | {"hidden_act": "tanh"})


def test_config_json_reading(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw_config("mistral")))
    assert load_config(tmp_path) == hf_config_to_hybrid(raw_config("mistral"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.json")

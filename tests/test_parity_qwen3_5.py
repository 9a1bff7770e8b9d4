"""Qwen3.5 (dense, MoE, and the text part of the multimodal checkpoint) end to end against HF transformers (CPU, fp32).

Tiny random ``Qwen3_5ForCausalLM`` (``_hf_mamba_models.qwen3_5``: DeltaNet layers with unfused projections and two
value heads per key head, gated attention with biases and a partial multimodal RoPE, zero-centred norms, a dense
MLP everywhere, tied embeddings), ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe``: experts with a gated shared expert on
every layer) and ``Qwen3_5ForConditionalGeneration`` (``qwen3_5_vl``: the decoder under ``model.language_model``
beside a vision tower, which is skipped) are written by ``save_pretrained`` and loaded by hybridkv from that
directory. The engine checks are Qwen3-Next's (``test_parity_lfm2.check_engine_greedy``): ``LLM.generate`` with
4-token blocks and an 8-token step budget, greedy tokens equal to HF's and every sampled row's logits within 1e-4,
with prefix caching off and on. The config translation is checked against HF's config classes, their defaults
included (a hub config keeps only the non-default fields).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _hf_mamba_models import BUILDERS
from test_parity_lfm2 import Checkpoint, check_engine_greedy, check_gpu_backend, check_reference_forward
from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models import MLP, Attention, GatedDeltaNet, MoE


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = BUILDERS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Checkpoint(hf, path)


@pytest.mark.slow            # ~15 s on 2 cores per caching mode, plus the HF oracle (~5 s, once per checkpoint)
@pytest.mark.parametrize("caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_engine_greedy_matches_hf(ckpt: Checkpoint, caching: bool) -> None:
    check_engine_greedy(ckpt, caching, {"GatedDeltaNet", "Attention"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_backend_matches_hf(ckpt: Checkpoint, backend: str) -> None:
    check_gpu_backend(ckpt, backend)


@pytest.mark.slow            # the HF oracle of three checkpoints
def test_reference_forward_matches_hf(ckpt: Checkpoint) -> None:
    check_reference_forward(ckpt)


# -- config translation, against HF's own config classes ---------------------------------------------------------
_BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def _check_layers(config: Any, hf: Any, moe: bool) -> None:
    assert config.norm == "gemma_rms" and config.norm_eps == hf.rms_norm_eps
    for layer, kind in zip(config.layers, hf.layer_types, strict=True):
        if kind == "full_attention":
            assert isinstance(layer.mixer, Attention) and layer.mixer.output_gate and layer.mixer.qk_norm == "rms"
            assert layer.mixer.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
        else:
            assert layer.mixer == GatedDeltaNet(
                num_k_heads=hf.linear_num_key_heads, num_v_heads=hf.linear_num_value_heads,
                head_k_dim=hf.linear_key_head_dim, head_v_dim=hf.linear_value_head_dim,
                conv_kernel=hf.linear_conv_kernel_dim, norm_eps=hf.rms_norm_eps)
        if moe:
            assert layer.ffn == MoE(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                                    intermediate_size=hf.moe_intermediate_size, renormalize=True,
                                    shared_intermediate_size=hf.shared_expert_intermediate_size, shared_gate=True)
        else:
            assert layer.ffn == MLP(intermediate_size=hf.intermediate_size)


@pytest.mark.parametrize("extra", [
    dict(num_hidden_layers=8),                                             # full attention every 4th layer
    dict(num_hidden_layers=6, full_attention_interval=3),
    dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"]),
])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_config_translation_follows_hf(extra: dict, moe: bool) -> None:
    hf = Qwen3_5MoeTextConfig(**_BASE, **_MOE, **extra) if moe else Qwen3_5TextConfig(**_BASE, **extra)
    arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    _check_layers(hf_config_to_hybrid({"architectures": [arch], **hf.to_dict()}), hf, moe)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_multimodal_config_reads_its_text_part(moe: bool) -> None:
    """The text part's fields; the multimodal config's own ``tie_word_embeddings`` decides the tying, as HF's
    ``...ForConditionalGeneration`` reads it."""
    text = dict(_BASE, num_hidden_layers=4, tie_word_embeddings=True, **(_MOE if moe else {}))
    hf = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, tie_word_embeddings=False)
    raw = hf.to_dict()
    raw["architectures"] = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    config = hf_config_to_hybrid(raw)
    _check_layers(config, hf.text_config, moe)
    assert not config.tie_word_embeddings and config.architecture == raw["architectures"][0]
    assert hf_config_to_hybrid({**raw, "tie_word_embeddings": True}).tie_word_embeddings


@pytest.mark.parametrize("model_type, hf_class", [
    ("qwen3_5_text", Qwen3_5TextConfig), ("qwen3_5_moe_text", Qwen3_5MoeTextConfig), ("qwen3_5", Qwen3_5Config),
    ("qwen3_5_moe", Qwen3_5MoeConfig)])
def test_defaults_are_hf_defaults(model_type: str, hf_class: type) -> None:
    """A config of nothing but its ``model_type`` reads as HF's class defaults (the 9B and 35B-A3B sizes)."""
    assert hf_config_to_hybrid({"model_type": model_type}) == hf_config_to_hybrid(hf_class().to_dict())


def test_config_errors() -> None:
    base = {"architectures": ["Qwen3_5ForCausalLM"], **_BASE, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="hidden_act"):
        hf_config_to_hybrid({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        hf_config_to_hybrid({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="must divide num_v_heads"):
        hf_config_to_hybrid({**base, "linear_num_key_heads": 3})


def test_weight_names_of_the_hub_checkpoints() -> None:
    """The hub's multimodal layout (decoder under ``model.language_model.``, stacked experts), its vision tower and
    multi-token-prediction head read past, both decoder prefixes for the causal-LM classes."""
    from hybridkv.loaders.families.qwen3_5 import qwen3_5

    config = hf_config_to_hybrid(Qwen3_5MoeTextConfig(**_BASE, **_MOE, num_hidden_layers=4).to_dict())
    lm = "model.language_model.layers.0."
    assert [t.name for t in qwen3_5(lm + "linear_attn.in_proj_qkv.weight", config)] == [
        "layers.0.mixer.in_proj_qkv.weight"]
    assert [t.name for t in qwen3_5(lm + "mlp.experts.gate_up_proj", config)] == [
        "layers.0.ffn.gate_proj", "layers.0.ffn.up_proj"]
    assert [t.index for t in qwen3_5(lm + "mlp.experts.3.down_proj.weight", config)] == [(3,)]
    assert qwen3_5("model.layers.3.self_attn.q_norm.weight", config)[0].name == "layers.3.mixer.q_norm.weight"
    assert qwen3_5("model.language_model.norm.weight", config)[0].name == "norm.weight"
    assert qwen3_5("mtp.layers.0.mlp.gate.weight", config) == []
    assert qwen3_5("model.visual.blocks.0.attn.qkv.weight", config) == []

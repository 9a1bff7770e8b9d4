"""Qwen3-Next (Gated DeltaNet + gated attention + experts) end to end against HF transformers (CPU, fp32).

A tiny random ``Qwen3NextForCausalLM`` (``_hf_mamba_models.qwen3_next``: DeltaNet layers with two value heads per
key head, gated attention with biases and a partial RoPE, zero-centred norms, softmax experts with a gated shared
expert beside one dense layer) is written by ``save_pretrained`` and loaded by hybridkv from that directory. Every
prompt runs through ``LLM.generate`` with 4-token blocks and an 8-token step budget, so each is a chunked prefill
(conv and recurrent states carried across chunks); greedy tokens must equal HF's (a full forward per step, no HF
cache) and every sampled position's logits be within 1e-4 — with prefix caching off and on. Two prompts share a
22-token prefix: with caching on the second starts from a state checkpoint (``num_cached_tokens`` > 0), one request
after the other and both in one batch. The config translation is checked against HF's ``Qwen3NextConfig``, the
gated attention (through ``LayerHarness``) and the experts with their gated shared expert against HF's modules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _hf_mamba_models import BUILDERS
from _layer_harness import LayerHarness
from test_layers_vs_hf import SCHEDULES, SEQ, additive_mask, assert_close, hidden, load_exact, randomize, same_names
from test_parity_lfm2 import Checkpoint, check_engine_greedy, check_gpu_backend, check_reference_forward
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from hybridkv.layers.attention import AttentionLayer
from hybridkv.layers.moe import MoEFeedForward
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models import MLP, Attention, GatedDeltaNet, MoE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = BUILDERS["qwen3_next"]()
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    return Checkpoint(hf, path)


@pytest.mark.slow            # ~20 s on 2 cores per caching mode, plus the HF oracle (~20 s, once per module)
@pytest.mark.parametrize("caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_engine_greedy_matches_hf(ckpt: Checkpoint, caching: bool) -> None:
    check_engine_greedy(ckpt, caching, {"GatedDeltaNet", "Attention"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_backend_matches_hf(ckpt: Checkpoint, backend: str) -> None:
    """The triton backend: its conv1d and gated-delta-rule kernels."""
    check_gpu_backend(ckpt, backend)


@pytest.mark.slow            # the module's HF oracle takes ~20 s to build on 2 cores
def test_reference_forward_matches_hf(ckpt: Checkpoint) -> None:
    check_reference_forward(ckpt)


# -- config translation, against HF's own config class -----------------------------------------------------------
_BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


@pytest.mark.parametrize("extra", [
    dict(num_hidden_layers=8),                                             # full attention every 4th layer
    dict(num_hidden_layers=6, full_attention_interval=3, mlp_only_layers=[0, 4]),
    dict(num_hidden_layers=4, decoder_sparse_step=2),                      # experts on layers 1 and 3 only
    dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"]),
    dict(num_hidden_layers=4, num_experts=0),                              # dense everywhere
])
def test_config_translation_follows_hf(extra: dict) -> None:
    hf = Qwen3NextConfig(**(_BASE | extra))
    config = hf_config_to_hybrid({"architectures": ["Qwen3NextForCausalLM"], **hf.to_dict()})
    assert config.norm == "gemma_rms" and config.norm_eps == hf.rms_norm_eps
    for i, (layer, kind) in enumerate(zip(config.layers, hf.layer_types, strict=True)):
        if kind == "full_attention":
            assert isinstance(layer.mixer, Attention) and layer.mixer.output_gate and layer.mixer.qk_norm == "rms"
            assert layer.mixer.rope.partial_rotary_factor == 0.25
        else:
            assert layer.mixer == GatedDeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                                                conv_kernel=4, norm_eps=hf.rms_norm_eps)
        sparse = hf.num_experts > 0 and i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0
        if sparse:
            assert isinstance(layer.ffn, MoE) and layer.ffn.shared_gate and layer.ffn.router == "softmax"
            assert (layer.ffn.top_k, layer.ffn.shared_intermediate_size) == (2, 24)
        else:
            assert layer.ffn == MLP(intermediate_size=hf.intermediate_size)


def test_config_errors() -> None:
    base = {"architectures": ["Qwen3NextForCausalLM"], **_BASE, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="hidden_act"):
        hf_config_to_hybrid({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        hf_config_to_hybrid({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="unknown layer type 'mamba'"):
        hf_config_to_hybrid({**base, "layer_types": ["mamba", "full_attention"]})
    with pytest.raises(ValueError, match="must divide num_v_heads"):
        hf_config_to_hybrid({**base, "linear_num_key_heads": 3})


# -- the family's parts against HF's modules ---------------------------------------------------------------------
def _tiny_hf_config(**kw: Any) -> Qwen3NextConfig:
    return Qwen3NextConfig(**(_BASE | dict(hidden_size=32, num_hidden_layers=1, rms_norm_eps=1e-6,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                            "partial_rotary_factor": 0.5}) | kw))


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_gated_attention_matches_hf(sched: str) -> None:
    """q_proj's [q | gate] rows per head, zero-centred q/k norms, partial RoPE, sigmoid output gate."""
    cfg = _tiny_hf_config(attention_bias=True)
    cfg._attn_implementation = "eager"
    hf = hf_qwen3_next.Qwen3NextAttention(cfg, 0).eval()
    randomize(hf, 0)
    with torch.no_grad():
        for norm in (hf.q_norm, hf.k_norm):
            norm.weight.normal_(0.0, 0.1)
    config = hf_config_to_hybrid({"architectures": ["Qwen3NextForCausalLM"], **cfg.to_dict(),
                                  "layer_types": ["full_attention"]})
    ours = AttentionLayer(32, config.layers[0].mixer, cache_name="attn", norm_eps=1e-6, gemma_norm=True)
    load_exact(ours, same_names(hf, [f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")]
                                + ["q_norm.weight", "k_norm.weight"]))
    x = hidden(SEQ, 32, seed=1)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=3).run(x, SCHEDULES[sched])
    rotary = hf_qwen3_next.Qwen3NextRotaryEmbedding(cfg)
    with torch.no_grad():
        pe = rotary(x[None], torch.arange(SEQ)[None])
        want = hf(hidden_states=x[None], position_embeddings=pe, attention_mask=additive_mask(SEQ))[0][0]
    assert_close(out, want)


def test_moe_with_gated_shared_expert_matches_hf() -> None:
    cfg = _tiny_hf_config()
    cfg._experts_implementation = "eager"
    hf = hf_qwen3_next.Qwen3NextSparseMoeBlock(cfg).eval()
    randomize(hf, 1, scale=0.3)
    moe = hf_config_to_hybrid({"architectures": ["Qwen3NextForCausalLM"], **cfg.to_dict()}).layers[0].ffn
    ours = MoEFeedForward(32, moe)
    params = dict(hf.named_parameters())
    gate, up = params["experts.gate_up_proj"].detach().chunk(2, dim=1)
    load_exact(ours, {"router.weight": params["gate.weight"], "gate_proj": gate, "up_proj": up,
                      "down_proj": params["experts.down_proj"],
                      "shared_gate.weight": params["shared_expert_gate.weight"],
                      **{f"shared.{p}_proj.weight": params[f"shared_expert.{p}_proj.weight"]
                         for p in ("gate", "up", "down")}})
    x = hidden(20, 32, seed=2)
    with torch.no_grad():
        assert_close(ours(x), hf(x[None])[0])

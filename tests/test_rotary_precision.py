"""The RoPE frequency table stays fp32 when a model is cast to bf16 (long positions need it)."""

from __future__ import annotations

import torch

from hybridkv.models import Attention, HybridConfig, Layer, Rope
from hybridkv.models.hybrid import build_model


def test_inv_freq_stays_fp32_through_dtype_casts():
    cfg = HybridConfig(vocab_size=16, hidden_size=32, dtype="bfloat16", layers=(
        Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16, rope=Rope(theta=500000.0))),))
    model = build_model(cfg)
    rotary = model.layers[0].mixer.rotary
    reference = build_model(cfg, dtype=torch.float32).layers[0].mixer.rotary.inv_freq
    assert next(model.parameters()).dtype == torch.bfloat16
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, reference)
    model.to(torch.float16).to(torch.bfloat16)
    assert torch.equal(rotary.inv_freq, reference)

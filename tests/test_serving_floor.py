"""The physical floor of ``benchmarks/serving.py`` counts a MoE model's routed experts as what a token reads: top_k
of E per token, at most min(B * top_k, E) experts per decode step (not every expert, as dense weights), Gemma-4's
experts beside a dense MLP (``DenseMoE``) too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridkv import LLM
from hybridkv.models import MLP, Attention, HybridConfig, Layer, MoE
from hybridkv.models.config import DenseMoE
from hybridkv.models.hybrid import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("dense_beside", [False, True])
def test_routed_experts_count_top_k_of_e(dense_beside: bool) -> None:
    from serving import model_cost

    hidden, inter, experts = 16, 24, 4
    moe = MoE(num_experts=experts, top_k=2, intermediate_size=inter, renormalize=True)
    ffn = DenseMoE(mlp=MLP(intermediate_size=inter), moe=moe) if dense_beside else moe
    config = HybridConfig(vocab_size=64, hidden_size=hidden, max_position_embeddings=64, dtype="float32",
                          layers=(Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=8), ffn=ffn),
                                  Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=8),
                                        ffn=MLP(intermediate_size=inter))))
    llm = LLM(build_model(config, seed=0), device="cpu", kv_cache_memory="4MiB", max_num_seqs=4)
    cost = model_cost(llm, [1, 2, 8])
    per_expert = 3 * inter * hidden
    total = sum(p.numel() for p in llm.model.parameters())
    embed = llm.model.embed_tokens.weight.numel()
    assert cost.params_per_token == total - embed - (experts - 2) * per_expert       # top-2 of 4
    b1, b2, b8 = (cost.weight_bytes[b] for b in (1, 2, 8))
    assert (b2 - b1, b8 - b1) == (4 * 2 * per_expert, 4 * 2 * per_expert)     # fp32: 2 experts a row, at most 4

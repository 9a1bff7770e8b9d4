"""The physical floor of ``benchmarks/serving.py`` counts a MoE model's routed experts as what a token reads: top_k
of E per token, at most min(B * top_k, E) experts per decode step (not every expert, as dense weights)."""

from __future__ import annotations

import sys
from pathlib import Path

from hybridkv import LLM
from hybridkv.models import MLP, Attention, HybridConfig, Layer, MoE
from hybridkv.models.hybrid import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_routed_experts_count_top_k_of_e() -> None:
    from serving import model_cost

    hidden, inter, experts = 16, 24, 4
    moe = MoE(num_experts=experts, top_k=1, intermediate_size=inter)
    config = HybridConfig(vocab_size=64, hidden_size=hidden, max_position_embeddings=64, dtype="float32",
                          layers=(Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=8), ffn=moe),
                                  Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=8),
                                        ffn=MLP(intermediate_size=inter))))
    llm = LLM(build_model(config, seed=0), device="cpu", kv_cache_memory="4MiB", max_num_seqs=4)
    cost = model_cost(llm, [1, 2, 8])
    per_expert = 3 * inter * hidden
    total = sum(p.numel() for p in llm.model.parameters())
    embed = llm.model.embed_tokens.weight.numel() if hasattr(llm.model, "embed_tokens") else 0
    assert embed > 0
    assert cost.params_per_token == total - embed - (experts - 1) * per_expert
    b1, b2, b8 = (cost.weight_bytes[b] for b in (1, 2, 8))
    assert (b2 - b1, b8 - b1) == (4 * per_expert, 4 * 3 * per_expert)      # fp32: one more expert per row, up to 4

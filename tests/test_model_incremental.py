"""Incremental decoding through the paged cache == one full forward (fp32 logits), for a custom mix of all
four layer kinds, with batches that mix decodes and chunked prefills and block ids shuffled in the pool.

The schedule (which request computes how many tokens in each step) is drawn by hypothesis; block ids are
a random permutation of the pool, so no layout accident can make the test pass. The scheduler and the
coordinator are not involved: this checks the model, the runner, the builders and the transforms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.engine.model_runner import ModelRunner, StepBatch, reference_logits
from hybridkv.kv_groups import plan_kv_cache
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, Rope
from hybridkv.models.hybrid import build_model

BLOCK = 4


def mix() -> HybridConfig:
    layers = (
        Layer(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=5),
              ffn=MLP(intermediate_size=32)),
        Layer(mixer=Mamba2(num_heads=4, head_dim=8, state_size=4, n_groups=2, chunk_size=4),
              ffn=MoE(num_experts=3, top_k=2, intermediate_size=16)),
        Layer(mixer=Attention(num_heads=4, num_kv_heads=1, head_dim=8, attention_chunk_size=8,
                              rope=Rope(interleaved=True), qk_norm="rms_weightless"), ffn=MLP(intermediate_size=32)),
        Layer(mixer=Attention(num_heads=4, num_kv_heads=4, head_dim=8, rope=None, softcap=20.0),
              ffn=MLP(intermediate_size=32, activation="gelu_tanh")),
    )
    return HybridConfig(vocab_size=53, hidden_size=32, layers=layers, max_position_embeddings=64, dtype="float32")


@pytest.fixture(scope="module")
def setup():
    model = build_model(mix(), seed=3)
    specs = model.config.kv_specs(block_size=BLOCK)
    plan = plan_kv_cache(specs, max_model_len=64, kv_memory=4 << 20, max_num_seqs=8, step_tokens=64)
    return model, plan


@pytest.mark.slow       # 12 random schedules over all four layer kinds; the parity tests keep the invariant quick
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_incremental_equals_full_forward(setup, data):
    model, plan = setup
    runner = ModelRunner(model, plan, backend="torch")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    num_reqs = data.draw(st.integers(1, 4))
    lengths = [data.draw(st.integers(1, 40)) for _ in range(num_reqs)]
    seqs = [rng.integers(0, 53, n).tolist() for n in lengths]
    # Disjoint shuffled block ids per (group, request); one state slot per request.
    ids = iter(rng.permutation(np.arange(1, plan.num_blocks)).tolist())
    width = -(-64 // BLOCK)
    tables = [np.array([[next(ids) for _ in range(width)] for _ in range(num_reqs)], np.int32)
              if g.spec.is_attention else np.arange(1, num_reqs + 1, dtype=np.int32)[:, None]
              for g in plan.groups]
    done = [0] * num_reqs
    got = [[] for _ in range(num_reqs)]
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        live = [r for r in range(num_reqs) if done[r] < lengths[r]]
        # decodes (1-token continuations) first, as the scheduler guarantees
        step = {r: data.draw(st.integers(1, lengths[r] - done[r])) for r in live}
        live.sort(key=lambda r: not (step[r] == 1 and done[r] > 0))
        q = np.array([step[r] for r in live])
        s = np.array([done[r] + step[r] for r in live])
        batch = StepBatch(input_ids=np.concatenate([seqs[r][done[r]:done[r] + step[r]] for r in live]).astype(np.int64),
                          query_lens=q, seq_lens=s, block_tables=[t[live] for t in tables],
                          logits_indices=np.arange(int(q.sum())))
        logits = runner.execute(batch).logits
        offset = 0
        for r in live:
            got[r].append(logits[offset:offset + step[r]])
            offset += step[r]
            done[r] += step[r]
    for r in range(num_reqs):
        ours = torch.cat(got[r])
        ref = reference_logits(model, seqs[r], backend="torch")
        assert (ours - ref).abs().max().item() <= 1e-4, f"request {r} of lengths {lengths}"

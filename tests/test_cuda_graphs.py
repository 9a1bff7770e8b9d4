"""CUDA graphs for decode (``engine/cuda_graphs.py``).

On the CPU: the bucket sizes, and the buffer width bound against the real transforms (random decode
batches: every transformed table must fit the captured width). On a GPU: generation with graphs is
token-identical to eager for every layer kind (full, sliding, chunked-local, Mamba2, short conv; MoE FFNs),
including batches that need padding and batches that shrink as requests finish.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.backends.builders import AttentionInputs, build_group_inputs, decode_table_width
from hybridkv.engine.cuda_graphs import default_buckets
from hybridkv.kv_groups.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, ShortConv

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, (1,)),
    (3, (1, 2, 3)),
    (8, (1, 2, 4, 8)),
    (20, (1, 2, 4, 8, 16, 20)),
    (256, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)),
])
def test_default_buckets(max_num_seqs: int, expected: tuple[int, ...]) -> None:
    assert default_buckets(max_num_seqs) == expected


_SPECS = {
    "full": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32),
    "sliding": SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=10),
    "chunked": ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                         attention_chunk_size=12),
}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(_SPECS)), lens=st.lists(st.integers(2, 60), min_size=1, max_size=6))
def test_decode_tables_fit_the_captured_width(kind: str, lens: list[int]) -> None:
    """Whatever a group's builder does to a decode batch, each row keeps one query and the table fits
    ``decode_table_width`` (what the persistent buffer holds)."""
    spec, max_len = _SPECS[kind], 64
    seq = np.array(lens, np.int32)
    width = -(-int(seq.max()) // spec.block_size)
    table = np.arange(1, len(lens) * width + 1, dtype=np.int32).reshape(len(lens), width)
    cam = CommonAttentionMetadata.build(query_lens=np.ones(len(lens), np.int32), seq_lens=seq,
                                        block_table=table, block_size=spec.block_size)
    built = build_group_inputs(spec, cam)
    assert isinstance(built, AttentionInputs)
    assert built.cam.num_reqs == len(lens)
    assert built.cam.block_table_cpu.shape[1] <= decode_table_width(spec, max_model_len=max_len)


def _mix_config() -> HybridConfig:
    attn = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    moe = MoE(num_experts=4, top_k=1, intermediate_size=64, router="sigmoid_input", shared_intermediate_size=64)
    mixers = (Attention(sliding_window=24, **attn), Mamba2(num_heads=4, head_dim=16, state_size=16, n_groups=1),
              Attention(attention_chunk_size=32, **attn), Attention(**attn), ShortConv(channels=64, bias=True))
    return HybridConfig(vocab_size=256, hidden_size=64, max_position_embeddings=512, dtype="float32",
                        layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=128) if i % 2 else moe)
                                     for i, m in enumerate(mixers)))


@gpu
def test_graphs_match_eager_tokens() -> None:
    """Greedy generation with captured decode steps == eager, over a batch that shrinks (different
    max_tokens) and sizes that fall between buckets (padding). fp32: a padded batch may pick other GEMM
    tiles than the unpadded one, and in bf16 that rounding alone flips near-tied argmaxes of a random model."""
    from hybridkv import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 90, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(20, 70, 11)]
    runs = {}
    for graphs in (False, True):
        llm = LLM(_mix_config(), device="cuda", backend="triton", max_num_seqs=16, kv_cache_memory=64 << 20,
                  cuda_graphs=graphs, seed=0)
        assert (llm.engine.runner.graphs is not None) == graphs
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]


@gpu
def test_graph_and_eager_steps_interleave_through_the_pending_tokens() -> None:
    """Requests arriving while others decode: eager steps (prefills) and graph steps alternate, each taking
    its pending input ids from the other kind's tokens (the graph's own buffer after a graph step, a copy
    into it after an eager or a sampled one); greedy and seeded-sampled requests mixed. == eager and
    synchronous."""
    from hybridkv import LLM, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 60, 9)]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.7, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(9)]
    runs = []
    for graphs in (False, True):
        llm = LLM(_mix_config(), device="cuda", backend="triton", max_num_seqs=8, kv_cache_memory=64 << 20,
                  cuda_graphs=graphs, async_scheduling=graphs, seed=0)
        eng, done = llm.engine, {}
        for step in range(200):
            if step % 4 == 0 and step // 4 < len(prompts):
                i = step // 4
                eng.add_request(str(i), prompts[i], params[i])
            for out in eng.step(only_finished=True):
                done[out.request_id] = out.outputs[0].token_ids
            if len(done) == len(prompts):
                break
        runs.append(done)
    assert runs[0] == runs[1]


@gpu
def test_graphs_requested_with_the_torch_backend_is_an_error() -> None:
    from hybridkv import LLM

    with pytest.raises(ValueError, match="cuda_graphs=True"):
        LLM(_mix_config(), device="cuda", backend="torch", max_num_seqs=4, kv_cache_memory=16 << 20,
            cuda_graphs=True)

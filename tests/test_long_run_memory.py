"""A long-running engine's memory does not grow with the requests it has served.

The engine (scheduler, KV coordinator, block pool, shared-prefix index, outputs) serves two equal windows of
requests with the model replaced by a stand-in step (``benchmarks/_sleep_engine.SleepRunner``: no compute, the
engine's own bookkeeping only), sliding-window and full attention groups, prompts of which half share a first block,
streamed and final outputs; ``tracemalloc`` compares what is allocated after each window. What a server must hold
is bounded by its pool and its running requests, both the same at the two snapshots, so the difference is
allocator noise; a structure that keeps something per request or per step shows as tens to hundreds of KiB.
Two such were found this way: an empty LRU entry per free call of unkeyed blocks (``BlockPool.free``, ~0.8 KiB a
request here without prefix caching) and a generation counter per distinct first block
(``SharedPrefixIndex.remove``)."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.request import OutputKind
from hybridkv.models import MLP, Attention, HybridConfig, Layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WINDOW = 1200                   # requests a window
NOISE = 16 << 10                # bytes: dict and deque resizes, the last step's objects


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_serving_more_requests_holds_no_more_memory(prefix_caching: bool) -> None:
    from _sleep_engine import SleepRunner

    attn = dict(num_heads=2, num_kv_heads=1, head_dim=16)
    layers = tuple(Layer(mixer=Attention(**attn) if i % 3 == 2 else Attention(sliding_window=32, **attn),
                         ffn=MLP(intermediate_size=16)) for i in range(6))
    config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="float32",
                          layers=layers)
    llm = LLM(config, device="cpu", block_size=8, max_num_seqs=32, kv_cache_memory=4 << 20,
              enable_prefix_caching=prefix_caching)
    eng = llm.engine
    eng.runner = SleepRunner(llm.plan, eng.vocab_size, step_s=0.0, token_s=0.0, first=3)
    rng = np.random.default_rng(0)
    added = 0

    def serve(n: int) -> None:
        nonlocal added
        target = added + n
        while added < target or eng.has_unfinished:
            while added < target and eng.num_unfinished_requests < 24:
                params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 40)), ignore_eos=True)
                prompt = ([7] * 32 if added % 2 else []) + rng.integers(3, 250, int(rng.integers(1, 120))).tolist()
                eng.add_request(f"r{added}", prompt, params,
                                output_kind=OutputKind.DELTA if added % 2 else OutputKind.FINAL)
                added += 1
            eng.step()

    serve(WINDOW // 2)              # (the pool and the prefix cache fill up first)
    tracemalloc.start()
    try:
        serve(WINDOW)
        gc.collect()
        before = tracemalloc.take_snapshot()
        serve(WINDOW)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grew = after.compare_to(before, "lineno")
    total = sum(s.size_diff for s in grew)
    assert total < NOISE, f"{total >> 10} KiB more after {WINDOW} more requests: " + "; ".join(map(str, grew[:3]))
    assert eng.coordinator.num_requests == 0 and eng.coordinator.num_free_blocks == llm.plan.num_blocks - 1

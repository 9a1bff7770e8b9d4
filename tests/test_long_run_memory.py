"""A long-running engine's memory does not grow with the requests it has served.

The engine (scheduler, KV coordinator, block pool, shared-prefix index, outputs) serves two equal windows of
requests with the model replaced by a stand-in step (``benchmarks/_sleep_engine.SleepRunner``: no compute, the
engine's own bookkeeping only), sliding-window and full attention groups, prompts of which half share a first block,
streamed and final outputs; ``tracemalloc`` compares what is allocated after each window. What a server must hold
is bounded by its pool and its running requests, both the same at the two snapshots, so the difference is
allocator noise; a structure that keeps something per request or per step shows as tens to hundreds of KiB.
Three such were found this way: an empty LRU entry per free call of unkeyed blocks (``BlockPool.free``, ~0.8 KiB a
request here without prefix caching), a generation counter per distinct first block (``SharedPrefixIndex.remove``),
and, through ``AsyncLLM``, every event loop that ever submitted a request (``LoopWaker`` held its loop, the key of the
weak dictionary that keeps the wakers)."""

from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridkv import LLM, EngineConfig, SamplingParams
from hybridkv.engine.request import OutputKind
from hybridkv.models import MLP, Attention, HybridConfig, Layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WINDOW = 1200                   # requests a window
# Bytes: dict and deque resizes, the last step's objects (~4-10 KB measured; with the engine on a thread of its own,
# its last steps' temporaries too, up to ~18 KB). The leaks it found grew by 70-990 KB a window.
NOISE = 32 << 10
ASYNC_NOISE = 64 << 10


def _config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=16)
    layers = tuple(Layer(mixer=Attention(**attn) if i % 3 == 2 else Attention(sliding_window=32, **attn),
                         ffn=MLP(intermediate_size=16)) for i in range(6))
    return HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="float32", layers=layers)


def _grown(serve) -> tuple[int, list]:
    """Bytes more allocated after one more window of ``serve`` than after the one before (and the top lines)."""
    tracing = tracemalloc.is_tracing()      # (a session run with -X tracemalloc keeps its tracing)
    if not tracing:
        tracemalloc.start()
    try:
        serve()
        gc.collect()
        before = tracemalloc.take_snapshot()
        serve()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        if not tracing:
            tracemalloc.stop()
    grew = after.compare_to(before, "lineno")
    return sum(s.size_diff for s in grew), grew[:3]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_serving_more_requests_holds_no_more_memory(prefix_caching: bool) -> None:
    from _sleep_engine import SleepRunner

    config = _config()
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
    total, top = _grown(lambda: serve(WINDOW))
    assert total < NOISE, f"{total >> 10} KiB more after {WINDOW} more requests: " + "; ".join(map(str, top))
    assert eng.coordinator.num_requests == 0 and eng.coordinator.num_free_blocks == llm.plan.num_blocks - 1


def test_an_async_front_used_from_ever_new_event_loops_holds_no_more_memory() -> None:
    """``AsyncLLM`` over the stand-in engine, its requests (two samples every other one; every fifth consumer
    leaving mid-stream, which aborts) submitted from a new ``asyncio.run`` every 20: nothing is kept of the loops
    that are gone, nor of the requests."""
    from _sleep_engine import sleep_llm

    from hybridkv.engine.async_llm import AsyncLLM

    threads = torch.get_num_threads()       # (``sleep_llm`` sets 1 for its process: later files keep theirs)
    # (no prefix caching: the cached blocks' queue, bounded by the pool, would move with the engine thread's timing)
    llm = sleep_llm(_config(), EngineConfig(device="cpu", block_size=8, max_num_seqs=32, kv_cache_memory=4 << 20,
                                            enable_prefix_caching=False), step_s=0.0, token_s=0.0)
    front = AsyncLLM(llm)
    rng = np.random.default_rng(0)

    async def one(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True, n=1 + i % 2)
        seen = 0
        async for _ in front.generate(rng.integers(3, 250, int(rng.integers(1, 80))).tolist(), params):
            seen += 1
            if i % 5 == 0 and seen == 2:
                break

    async def some(n: int) -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    def serve(n: int = WINDOW // 2) -> None:
        for _ in range(n // 20):
            asyncio.run(some(20))
        asyncio.run(front.snapshot())           # (at a step boundary: the aborts applied, the engine idle)

    try:
        serve(WINDOW // 4)
        total, top = _grown(serve)
        gc.collect()
        assert len(front._wakers) == 0          # (every loop is gone)
    finally:
        front.shutdown()
        torch.set_num_threads(threads)
    assert total < ASYNC_NOISE, f"{total >> 10} KiB more after {WINDOW // 2} more requests: " + "; ".join(map(str, top))


def test_a_waker_whose_loop_closed_keeps_no_stream() -> None:
    """A wake-up queued on a loop that then closes is dropped with it: the streams woken after that are not kept
    waiting for it (they would pile up, and hold the loop)."""
    from hybridkv.engine.async_llm import LoopWaker

    loop = asyncio.new_event_loop()
    waker = LoopWaker(loop)
    waker.wake(object())                        # queued with call_soon_threadsafe; the loop never runs it
    loop.close()
    for _ in range(3):
        waker.wake(object())
    assert waker._ready == [] and not waker._scheduled


def test_a_server_process_sets_its_start_up_heap_aside_from_the_collector() -> None:
    """``freeze_startup_heap`` (the engine and API processes, once started): what is alive is set aside, so a full
    collection no longer walks it; cyclic garbage made before is collected first, not kept."""
    from hybridkv.utils import freeze_startup_heap

    class Node:
        pass

    live = Node()
    live.me = live                          # a cycle still referenced: set aside
    dead = Node()
    dead.me = dead
    gone = weakref.ref(dead)
    del dead                                # cyclic garbage: collected
    try:
        assert freeze_startup_heap() > 0
        assert gone() is None
        assert not any(o is live for o in gc.get_objects())    # (the collector's generations no longer hold it)
    finally:
        gc.unfreeze()
    assert any(o is live for o in gc.get_objects())

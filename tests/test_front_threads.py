"""One engine, many consumers (``engine/front.py``, ``engine/async_llm.py``): threads calling ``LLM.generate`` /
``generate_stream`` (some leaving early), coroutines streaming through ``AsyncLLM`` (some cancelled), in
interleavings hypothesis draws. Every greedy output equals the one-request-at-a-time result, every seeded
sample its single-threaded twin, a stream left early saw a prefix of it, and afterwards the engine holds
nothing (no request, block or state slot). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import LLM, SamplingParams
from hybridkv.engine.async_llm import AsyncLLM, QueueFullError
from hybridkv.engine.distributed import TensorParallelError
from hybridkv.engine.front import EngineDeadError
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model

VOCAB = 61
TIMEOUT = 120.0
rng = np.random.default_rng(3)
PROMPTS = [rng.integers(2, VOCAB, int(n)).tolist() for n in (3, 9, 17, 5, 24, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=5, ignore_eos=True)


def config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=4), Attention(sliding_window=6, **attn),
              Attention(**attn))
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=64, dtype="float32",
                        eos_token_ids=(1,), layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=32))
                                                         for m in mixers))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(build_model(config(), seed=4), device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
               kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> dict[tuple[str, int], tuple[int, ...]]:
    """(kind, prompt) -> its tokens, one request at a time."""
    out = {}
    for i, p in enumerate(PROMPTS):
        out["greedy", i] = llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        out["sampled", i] = llm.generate([p], sampled(i), use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.check_idle()
    return out


def params_of(kind: str, i: int) -> SamplingParams:
    return GREEDY if kind == "greedy" else sampled(i)


# An op: ("generate" | "stream", kind, prompt indices, outputs to read before leaving (None: all)).
ops = st.tuples(st.sampled_from(["generate", "stream"]), st.sampled_from(["greedy", "sampled"]),
                st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
                st.one_of(st.none(), st.integers(0, 6)))
programs = st.lists(st.lists(ops, min_size=1, max_size=3), min_size=2, max_size=4)


def run_op(llm: LLM, op: tuple, expected: dict) -> None:
    """Run one op and check what it saw."""
    name, kind, idx, leave_after = op
    prompts = [PROMPTS[i] for i in idx]
    params = [params_of(kind, i) for i in idx]
    if name == "generate":
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected[kind, i] for i in idx]
        return
    seen: dict[str, tuple[int, ...]] = {}
    prompt_of: dict[str, int] = {}
    finished = set()
    stream = llm.generate_stream(prompts, params)
    for n, out in enumerate(stream):
        if leave_after is not None and n >= leave_after:
            break
        seen[out.request_id] = out.outputs[0].token_ids
        if out.finished:
            finished.add(out.request_id)
        prompt_of[out.request_id] = PROMPTS.index(list(out.prompt_token_ids))
    stream.close()
    for rid, toks in seen.items():
        want = expected[kind, prompt_of[rid]]
        assert toks == want if rid in finished else want[:len(toks)] == toks


def run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait(timeout=TIMEOUT)
                fn()
            except BaseException as err:     # reported below
                errors.append(err)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(programs=programs)
def test_threads_share_one_engine(llm: LLM, expected: dict, programs: list) -> None:
    run_threads([lambda ops=ops: [run_op(llm, op, expected) for op in ops] for ops in programs])
    llm.engine.check_idle()


# -- coroutines through AsyncLLM, beside threads ---------------------------------------------------------
async def stream_one(engine: AsyncLLM, kind: str, i: int, leave_after: int | None, expected: dict) -> None:
    tokens: list[int] = []
    finished = False
    task_stream = engine.submit(PROMPTS[i], params_of(kind, i))
    async with task_stream as stream:
        async for n, out in _enumerate(stream):
            if leave_after is not None and n >= leave_after:
                break
            tokens += out.outputs[0].token_ids
            finished = out.finished
    want = expected[kind, i]
    assert tuple(tokens) == want if finished else want[:len(tokens)] == tuple(tokens)


async def _enumerate(stream):
    n = 0
    async for out in stream:
        yield n, out
        n += 1


async def cancelled_one(engine: AsyncLLM, i: int, after: int) -> None:
    """A consumer cancelled while it waits (a client gone): its request is aborted."""
    got = asyncio.Event()

    async def consume() -> None:
        n = 0
        async for _ in engine.generate(PROMPTS[i], GREEDY):
            n += 1
            if n >= after:
                got.set()

    task = asyncio.create_task(consume())
    waiting = asyncio.create_task(got.wait())
    await asyncio.wait({task, waiting}, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)  # (or it finished)
    for t in (task, waiting):
        t.cancel()
    await asyncio.gather(task, waiting, return_exceptions=True)


coroutine_ops = st.lists(st.tuples(st.sampled_from(["stream", "cancel"]), st.sampled_from(["greedy", "sampled"]),
                                   st.integers(0, len(PROMPTS) - 1), st.one_of(st.none(), st.integers(1, 5))),
                         min_size=1, max_size=6)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(coroutines=coroutine_ops, threads=st.lists(st.lists(ops, min_size=1, max_size=2), max_size=2))
def test_coroutines_and_threads_share_one_engine(llm: LLM, expected: dict, coroutines: list, threads: list) -> None:
    engine = AsyncLLM(llm)
    try:
        async def main() -> None:
            jobs = [stream_one(engine, kind, i, n, expected) if what == "stream" else cancelled_one(engine, i, n or 1)
                    for what, kind, i, n in coroutines]
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=TIMEOUT)

        run_threads([lambda: asyncio.run(main())] +
                    [lambda ops=ops: [run_op(llm, op, expected) for op in ops] for ops in threads])
    finally:
        engine.shutdown(timeout=TIMEOUT)
    llm.engine.check_idle()


def test_a_cancelled_consumer_frees_its_request_at_the_next_step(llm: LLM) -> None:
    engine = AsyncLLM(llm)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main() -> tuple[int, int]:
        stream = engine.submit(PROMPTS[4], long)
        async for _ in stream:
            break
        task = asyncio.create_task(stream.result())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        snap = await engine.snapshot()             # between two steps, after the abort was applied
        idle = await asyncio.wrap_future(engine.front.at_step_boundary(lambda e: e.check_idle()))
        assert idle is None
        return snap.running, snap.waiting

    try:
        assert asyncio.run(main()) == (0, 0)
    finally:
        engine.shutdown(timeout=TIMEOUT)


def test_queue_bound_and_a_dead_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(build_model(config(), seed=4), device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
              kv_cache_memory=1 << 20)
    engine = AsyncLLM(llm, max_waiting=2)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main() -> None:
        with pytest.raises(QueueFullError):
            engine.submit(PROMPTS[0], SamplingParams(n=3, max_tokens=2))
        first = engine.submit(PROMPTS[1], long)
        await first.__anext__()                    # running: it no longer waits
        streams = [engine.submit(PROMPTS[i], long) for i in (2, 3)]
        monkeypatch.setattr(llm.engine.runner, "execute", _raise(TensorParallelError("rank 1 is gone")))
        for s in [first, *streams]:
            out = await asyncio.wait_for(s.result(), timeout=TIMEOUT)
            assert out.finished and "rank 1 is gone" in (out.error or "")
        assert "rank 1 is gone" in (engine.dead or "")
        with pytest.raises(EngineDeadError):
            engine.submit(PROMPTS[0], GREEDY)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown(timeout=TIMEOUT)


def _raise(err: BaseException) -> Callable[..., None]:
    def execute(*args: object) -> None:
        raise err
    return execute

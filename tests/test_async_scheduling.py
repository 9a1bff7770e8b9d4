"""Asynchronous scheduling (step N+1 prepared while step N runs; its tokens reach the host a step later)
changes nothing a user sees: same tokens, finish reasons, logprobs and text as synchronous scheduling, for
random workloads with stop tokens and strings, seeded sampling, preemption, prefix caching and tight token
budgets; aborts in flight; everything freed after each run. On the CPU the device work runs inline, but
the order of host work (schedule, launch, read back the step before, commit) is the CUDA one.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import LLM, SamplingParams
from hybridkv.engine.engine import STEP_SECONDS_BUCKETS
from hybridkv.engine.request import PENDING_TOKEN, RequestStatus
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model
from tests._triton import gpu

VOCAB = 23       # small: greedy continuations hit the stop tokens drawn below


def config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=4), Attention(sliding_window=6, **attn),
              Attention(attention_chunk_size=8, **attn), Attention(**attn))
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=128, dtype="float32",
                        eos_token_ids=(1,), layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=32)) for m in mixers))


class WordTokenizer:
    """Token t is the word "w<t>": stop strings can end a request in the middle of a step's tokens."""

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        assert PENDING_TOKEN not in ids, "a pending token reached the tokenizer"
        return " ".join(f"w{t}" for t in ids)


@pytest.fixture(scope="module")
def model():
    return build_model(config(), seed=3)


def make_llm(model, *, async_scheduling: bool, **kw) -> LLM:
    args = dict(device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=16, kv_cache_memory=1 << 20,
                tokenizer=WordTokenizer())
    return LLM(model, async_scheduling=async_scheduling, **(args | kw))


def summary(outs) -> list[tuple]:
    """What a user sees, logprob values apart (``logprob_values``)."""
    def ids(lps):
        return None if lps is None else [lp and (lp.token_id, [t for t, _ in lp.top]) for lp in lps]
    return [(o.error, ids(o.prompt_logprobs), [(c.token_ids, c.finish_reason, c.text, ids(c.logprobs))
                                               for c in o.outputs]) for o in outs]


def logprob_values(outs) -> np.ndarray:
    """A different batch composition moves these by float rounding: compared with a tolerance."""
    lps = [lp for o in outs for lp in (o.prompt_logprobs or ()) if lp is not None]
    lps += [lp for o in outs for c in o.outputs for lp in c.logprobs or ()]
    return np.array([v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))], np.float64)


def assert_all_free(llm: LLM) -> None:
    engine, coord = llm.engine, llm.engine.coordinator
    assert not engine.has_unfinished and coord.num_requests == 0
    assert coord.num_free_blocks == llm.plan.num_blocks - 1
    assert coord.slots.num_free_slots == coord.slots.num_working_slots


@pytest.mark.slow       # 15 random workloads run both ways; the tests below keep one of each case quick
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), budget=st.sampled_from([1, 3, 7, 16, 64]), tight=st.booleans(),
       caching=st.booleans())
def test_async_equals_sync(model, seed: int, budget: int, tight: bool, caching: bool) -> None:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, VOCAB, int(rng.integers(0, 9))).tolist()
    prompts, params = [], []
    for _ in range(int(rng.integers(1, 9))):
        prompts.append(prefix + rng.integers(2, VOCAB, int(rng.integers(1, 20))).tolist())
        kind = int(rng.integers(0, 5))
        common = dict(max_tokens=int(rng.integers(1, 40)), stop_token_ids=rng.integers(2, VOCAB, 2).tolist())
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, **common))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, top_k=5, seed=int(rng.integers(0, 99)), logprobs=2,
                                         **common))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, stop=[f"w{int(rng.integers(2, VOCAB))}"], **common))
        elif kind == 3:
            params.append(SamplingParams(temperature=1.0, seed=int(rng.integers(0, 99)), n=2, ignore_eos=True,
                                         **common))
        else:
            params.append(SamplingParams(temperature=0.0, prompt_logprobs=2, **common))
    memory = ((20_000 if budget <= 16 else 24_000) if tight else 1 << 20)     # tight: preemptions
    runs, values = [], []
    for mode in (False, True):
        llm = make_llm(model, async_scheduling=mode, max_num_batched_tokens=budget, kv_cache_memory=memory,
                       enable_prefix_caching=caching)
        for _ in range(2):                                       # the second time with prefix hits
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(summary(outs))
            values.append(logprob_values(outs))
        assert_all_free(llm)
        assert llm.engine.async_scheduling is mode
    assert runs[2:] == runs[:2]
    for a, b in zip(values[:2], values[2:], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_async_preempts_and_hits_the_cache(model) -> None:
    """The random test's regimes really happen under asynchronous scheduling: preemption and prefix hits."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] + [i + 2] * 3 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    sync = make_llm(model, async_scheduling=False, kv_cache_memory=20_000).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model, async_scheduling=True, kv_cache_memory=20_000)
    assert summary(llm.generate(prompts, params, use_tqdm=False)) == summary(sync)
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0
    assert_all_free(llm)


def test_outputs_lag_one_step_and_stream_in_order(model) -> None:
    """The first step prefills and samples, but its token arrives with the second step's outputs."""
    llm = make_llm(model, async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []                   # launched; nothing read back yet
    first = engine.step()
    assert [len(o.outputs[0].token_ids) for o in first] == [1]
    seen = list(first[0].outputs[0].token_ids)
    while engine.has_unfinished:
        for out in engine.step():
            toks = list(out.outputs[0].token_ids)
            assert toks[:len(seen)] == seen
            seen = toks
    sync = make_llm(model, async_scheduling=False).generate([[3, 4, 5]], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen == list(sync[0].outputs[0].token_ids)
    assert engine.stats().steps == 3             # the last token is never fed back: no fourth step
    assert_all_free(llm)


@pytest.mark.parametrize("mode", [False, True])
def test_step_intervals_count_busy_steps_only(model, mode: bool) -> None:
    """``EngineStats.step_seconds`` counts the time between two steps' starts while the engine stays busy: a
    three-token request adds two intervals (three with asynchronous scheduling, whose last step only reads the
    last token back); the idle time before the next request adds none, nor does the gap after an abort."""
    llm = make_llm(model, async_scheduling=mode)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    per_run = 3 if mode else 2
    for runs in (1, 2):
        llm.generate([[3, 4, 5]], params, use_tqdm=False)
        stats = llm.stats()
        assert len(stats.step_seconds) == len(STEP_SECONDS_BUCKETS) + 1
        assert sum(stats.step_seconds) == per_run * runs and stats.step_seconds_sum > 0
    engine.add_request("gone", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort("gone")
    while engine.has_unfinished:
        engine.step()
    before = llm.stats()
    time.sleep(1.1)                 # idle: a gap past the last bound (1 s)
    llm.generate([[3, 4, 5]], params, use_tqdm=False)
    after = llm.stats()
    assert after.step_seconds[-1] == before.step_seconds[-1]
    assert sum(after.step_seconds) - sum(before.step_seconds) == per_run


def test_streamed_prompt_logprobs_arrive_with_their_step(model) -> None:
    """A chunked prompt's logprobs stream chunk by chunk in the same outputs as with synchronous scheduling."""
    prompt = [(3 * i) % (VOCAB - 2) + 2 for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    seen = []
    for mode in (False, True):
        llm = make_llm(model, async_scheduling=mode, max_num_batched_tokens=8)
        seen.append([(len(o.outputs[0].token_ids), len(o.prompt_logprobs or ()))
                     for o in llm.generate_stream([prompt], params)])
    assert seen[0] == seen[1] and seen[0][-1] == (3, 20)
    one = make_llm(model, async_scheduling=True).generate([[5]], params, use_tqdm=False)[0]
    assert one.prompt_logprobs == (None,)


def test_abort_while_a_step_is_in_flight(model) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[2 + i, 9, 4, 7] for i in range(4)]
    sync = make_llm(model, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model, async_scheduling=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    for _ in range(4):
        for out in engine.step(only_finished=True):
            done[out.request_id] = out
    aborted = [engine._requests[f"r{i}"] for i in (1, 2)]
    assert any(r.num_pending for r in aborted)
    assert engine.abort("r1") and engine.abort("r2")
    assert all(r.status is RequestStatus.FINISHED and PENDING_TOKEN not in r.token_ids for r in aborted)
    while engine.has_unfinished:
        for out in engine.step(only_finished=True):
            done[out.request_id] = out
    assert sorted(done) == ["r0", "r3"]
    assert [done["r0"].outputs[0].token_ids, done["r3"].outputs[0].token_ids] == \
        [sync[0].outputs[0].token_ids, sync[3].outputs[0].token_ids]
    assert_all_free(llm)


def test_async_scheduling_needs_the_in_process_runner(model) -> None:
    assert make_llm(model, async_scheduling=None).engine.async_scheduling is False     # CPU: off by default
    with pytest.raises(ValueError, match="in-process model runner"):
        from hybridkv.engine.engine import LLMEngine

        llm = make_llm(model, async_scheduling=False)
        LLMEngine(llm.model, llm.plan, max_num_seqs=6, max_num_batched_tokens=16, runner=object(),  # type: ignore[arg-type]
                  async_scheduling=True)


@gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_async_equals_sync_on_the_gpu(graphs: bool) -> None:
    """On CUDA the tokens feed the next step on the device (eager and CUDA-graph steps alike)."""
    gpu_model = build_model(config(), seed=3, device=torch.device("cuda"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, int(rng.integers(3, 30))).tolist() for _ in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1)] * 2 + \
        [SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=24)]
    outs = []
    for mode in (False, True):
        llm = LLM(gpu_model, device="cuda", backend="triton", block_size=4, max_num_seqs=8, kv_cache_memory=1 << 22,
                  cuda_graphs=graphs, async_scheduling=mode)
        outs.append(summary(llm.generate(prompts, params, use_tqdm=False)))
    assert outs[0] == outs[1]

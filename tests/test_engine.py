"""End-to-end invariants of the engine on a tiny four-kind hybrid (CPU, fp32, greedy => bit-identical).

batched == one-by-one; preempted == not preempted; prefix caching on == off (with real hits); every
token budget == unbounded; everything freed after a run; seeded sampling independent of the batch;
bad requests rejected alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, Rope
from hybridkv.models.hybrid import build_model

VOCAB = 61


def tiny_config() -> HybridConfig:
    mamba = Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8)
    sliding = Attention(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=5)
    chunked = Attention(num_heads=4, num_kv_heads=2, head_dim=8, attention_chunk_size=8,
                        rope=Rope(interleaved=True), qk_norm="rms_weightless")
    full = Attention(num_heads=4, num_kv_heads=1, head_dim=8, rope=None, temperature_tuning=(0.1, 4.0))
    moe = MoE(num_experts=3, top_k=1, intermediate_size=16, router="sigmoid_input", shared_intermediate_size=16)
    layers = (Layer(mixer=mamba, ffn=MLP(intermediate_size=48)), Layer(mixer=sliding, ffn=moe),
              Layer(mixer=chunked, ffn=MLP(intermediate_size=48)), Layer(mixer=full, ffn=MLP(intermediate_size=48)))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=layers, max_position_embeddings=96,
                        dtype="float32", eos_token_ids=(0,))


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(), seed=1)


def make_llm(model, **kw) -> LLM:
    args = dict(device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=16, kv_cache_memory=1 << 20)
    return LLM(model, **(args | kw))


def prompts(n: int = 6, seed: int = 0, shared: int = 9) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, VOCAB, shared).tolist()
    return [prefix + rng.integers(1, VOCAB, int(rng.integers(1, 24))).tolist() for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_all_free(llm: LLM) -> None:
    coord = llm.engine.coordinator
    assert coord.num_requests == 0
    if llm.plan.attention_groups:
        assert coord.num_free_blocks == llm.plan.num_blocks - 1          # cached blocks count as free
    if llm.plan.mamba_groups:
        assert coord.slots.num_free_slots == coord.slots.num_working_slots


@pytest.fixture(scope="module")
def baseline(model) -> list[list[int]]:
    """Greedy continuations from the no-cache reference forward, one token at a time."""
    out = []
    for p in prompts():
        seq = list(p)
        for _ in range(GREEDY.max_tokens):
            seq.append(int(reference_logits(model, seq)[-1].argmax()))
        out.append(seq[len(p):])
    return out


def test_batched_equals_reference(model, baseline):
    llm = make_llm(model)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == baseline
    assert_all_free(llm)


def test_one_by_one_equals_batched(model, baseline):
    llm = make_llm(model)
    assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts()] == baseline
    assert_all_free(llm)


def test_preemption_changes_nothing(model):
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = tokens(make_llm(model).generate(prompts(), long, use_tqdm=False))
    llm = make_llm(model, kv_cache_memory=45_000)
    assert tokens(llm.generate(prompts(), long, use_tqdm=False)) == roomy
    assert llm.stats().preemptions > 0, "the cache was meant to be small enough to force preemption"
    assert_all_free(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_equals_off(model, baseline, caching):
    llm = make_llm(model, enable_prefix_caching=caching)
    ps = prompts()
    first = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    again = tokens(llm.generate(ps, GREEDY, use_tqdm=False))     # same prompts: hits when caching is on
    assert first == baseline and again == baseline
    hits = llm.stats().prefix_hit_tokens
    assert (hits > 0) if caching else (hits == 0)
    assert_all_free(llm)


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13, 64])
def test_every_token_budget(model, baseline, budget):
    llm = make_llm(model, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts(4), GREEDY, use_tqdm=False)) == baseline[:4]
    assert_all_free(llm)


def test_seeded_sampling_is_independent_of_the_batch(model):
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    ps = prompts()
    alone = tokens(make_llm(model).generate([ps[2]], sp, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    mixed = make_llm(model, max_num_batched_tokens=7).generate(ps, [others, others, sp, others, others, others],
                                                              use_tqdm=False)
    assert tokens(mixed)[2] == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert tokens(make_llm(model, seed=3).generate(ps, unseeded, use_tqdm=False)) == \
        tokens(make_llm(model, seed=3).generate(ps, unseeded, use_tqdm=False))


def test_n_samples_and_stop_tokens(model, baseline):
    llm = make_llm(model)
    out = llm.generate([prompts()[0]], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.token_ids for c in out.outputs}) > 1
    stop_at = baseline[0][3]
    out = llm.generate([prompts()[0]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.finish_reason == "stop" and got.token_ids[-1] == stop_at
    assert list(got.token_ids) == baseline[0][: baseline[0].index(stop_at) + 1]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_request_stops_at_its_own_tokens(model, baseline, asynchronous: bool):
    """The engine checks stops only where a token may end its request (a length limit, any live request's stop
    token or EOS, stop strings): one request's stop token ends that request alone, and a stop id that arrives
    with a later request is checked from then on. Each continuation equals the baseline cut at its own stop."""
    llm = make_llm(model, async_scheduling=asynchronous)
    ps, eng = prompts(), llm.engine
    cases = {  # request: (prompt index, stop ids, max_tokens)
        "a": (0, [baseline[0][3]], 10), "b": (0, [], 10), "c": (1, [baseline[0][3]], 10), "d": (2, [], 4)}
    for rid, (i, stop, limit) in cases.items():
        eng.add_request(rid, ps[i], SamplingParams(temperature=0.0, max_tokens=limit, stop_token_ids=stop,
                                                   ignore_eos=True))
    done: dict[str, list[int]] = {}
    late = baseline[3][5]
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                if out.request_id == "d":           # a stop id no live request had
                    eng.add_request("e", ps[3], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[late],
                                                               ignore_eos=True))
    for rid, (i, stop, limit) in [*cases.items(), ("e", (3, [late], 10))]:
        want = baseline[i][:limit]
        cut = next((j for j, t in enumerate(want) if t in stop), None)
        assert done[rid] == (want if cut is None else want[:cut + 1]), rid
    eng.check_idle()


def test_logprobs_match_the_reference(model):
    llm = make_llm(model)
    p = prompts()[1]
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                                           ignore_eos=True), use_tqdm=False)[0]
    seq = p + list(out.outputs[0].token_ids)
    ref = reference_logits(model, seq).log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == p[i]
        assert lp.logprob == pytest.approx(ref[i - 1, p[i]].item(), abs=1e-4)
        assert len(lp.top) == 2
    for j, lp in enumerate(out.outputs[0].logprobs):
        pos = len(p) - 1 + j
        assert lp.logprob == pytest.approx(ref[pos, lp.token_id].item(), abs=1e-4)
        assert lp.top[0][0] == lp.token_id                       # greedy: the sampled token is the best


def test_bad_requests_fail_alone(model, baseline):
    llm = make_llm(model)
    ps = prompts()
    batch = [ps[0], [], list(range(200)), [VOCAB + 5, 1], ps[1]]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "empty" in outs[1].error and "max_model_len" in outs[2].error and "token ids" in outs[3].error
    assert tokens([outs[0], outs[4]]) == [baseline[0], baseline[1]]
    assert_all_free(llm)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(n=0),
                                 dict(top_k=-3), dict(min_p=2.0), dict(stop=[""])])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**bad)


def test_streaming_yields_incremental_outputs(model, baseline):
    llm = make_llm(model)
    seen: dict[str, list[int]] = {}
    for out in llm.generate_stream(prompts(2), GREEDY):
        toks = list(out.outputs[0].token_ids)
        assert toks[: len(seen.get(out.request_id, []))] == seen.get(out.request_id, [])
        seen[out.request_id] = toks
    assert [seen["0.0"], seen["1.0"]] == baseline[:2]


def test_abort_frees_everything(model):
    llm = make_llm(model)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    for i in range(len(prompts())):
        assert engine.abort(f"r{i}")
    assert not engine.has_unfinished
    assert_all_free(llm)


def test_kv_budget_too_small_is_a_clear_error(model):
    with pytest.raises(ValueError, match="too small for one request"):
        make_llm(model, kv_cache_memory=10_000)


def test_deterministic_without_torch_threads_effects(model, baseline):
    """Results do not depend on the intra-op thread count (no reduction-order surprises in greedy): the baseline's
    count against another (one thread under pytest-xdist on 2 cores: then two)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        assert tokens(make_llm(model).generate(prompts(3), GREEDY, use_tqdm=False)) == baseline[:3]
    finally:
        torch.set_num_threads(threads)


def test_max_num_seqs_requests_run_together(model):
    """All max_num_seqs requests are admitted in the first step (regression: the prefix lookup took the
    last free row and admission then refused the request that held it)."""
    llm = make_llm(model, max_num_seqs=4, max_num_batched_tokens=256)
    engine = llm.engine
    for i, p in enumerate(prompts(4, seed=5, shared=0)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 4
    while engine.has_unfinished:
        engine.step()


def test_identical_prompts_share_the_prefill(model):
    """n samples of one prompt: the later samples wait one step and hit the prefix cache (Mamba layers
    included: the first prefill stops at its last block boundary, where the state is checkpointed). The
    prompt saves more than a step's token budget (3 x 16 tokens >= 16); with a larger budget the samples
    compute it in parallel instead of waiting a step."""
    sp = SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=6, ignore_eos=True)
    prompt = prompts()[3]
    on = make_llm(model, max_num_batched_tokens=16)
    off = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    samples_on = [c.token_ids for c in on.generate([prompt], sp, use_tqdm=False)[0].outputs]
    samples_off = [c.token_ids for c in off.generate([prompt], sp, use_tqdm=False)[0].outputs]
    assert samples_on == samples_off
    assert on.stats().prefix_hit_tokens == 3 * ((len(prompt) - 1) // 4 * 4)


def test_out_of_memory_at_start_is_a_clear_error(monkeypatch):
    """An allocation that does not fit says what was asked and what to lower (here: the KV cache)."""
    import hybridkv.engine.model_runner as model_runner

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model_runner, "allocate_kv_cache", no_memory)
    with pytest.raises(MemoryError, match=r"allocating the KV cache \(16\.00 MiB asked.*lower kv_cache_memory"):
        LLM(tiny_config(), device="cpu", kv_cache_memory=16 << 20)

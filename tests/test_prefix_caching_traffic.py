"""Prefix caching on the traffic shapes it must pay for, on tiny models of every mix (CPU, fp32, greedy).

Mixes: a Mamba2 + attention hybrid (NemotronH-like), Mamba2 alone, sliding window + global (Gemma-3-like), chunked
local + global (Llama-4-like), short convs + attention (LFM2-like: conv states checkpointed as Mamba's). Workloads:
a shared prefix whose length is not a multiple of the block size (unique parts of one length, or of random lengths),
exact repeats of mixed-length prompts, multi-turn chat (each turn = the previous prompt + its answer + new tokens),
and mixed prompts sharing nothing. For each: greedy tokens with caching on == off, hit tokens >= 90% of the reusable
tokens (the block-aligned prefix an earlier request computed: the shared prefix, the repeated prompt, the previous
turn's prompt + answer), fewer steps where something is shared and at most one more where nothing is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.front import EngineFront
from hybridkv.models import MLP, Attention, GatedDeltaNet, HybridConfig, Layer, Mamba2, ShortConv
from hybridkv.models.hybrid import HybridModel, build_model

VOCAB = 61
BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream of the host copies needs a GPU")


def config(mix: str) -> HybridConfig:
    mamba = Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=8)
    full = Attention(num_heads=2, num_kv_heads=1, head_dim=8)
    sliding = Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=7)
    chunked = Attention(num_heads=2, num_kv_heads=1, head_dim=8, attention_chunk_size=16)
    conv = ShortConv(channels=16, bias=True)
    deltanet = GatedDeltaNet(num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, chunk_size=8)
    mixers = {"mamba": (mamba, full, mamba), "mamba2": (mamba, mamba), "sliding": (sliding, sliding, full),
              "chunked": (chunked, chunked, full), "short_conv": (conv, full, conv),
              "gated_deltanet": (deltanet, full, deltanet)}[mix]
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=256, dtype="float32",
                        layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=24)) for m in mixers), eos_token_ids=(0,))


MIXES = ("mamba", "mamba2", "sliding", "chunked", "short_conv", "gated_deltanet")


@pytest.fixture(scope="module")
def models() -> dict[str, HybridModel]:
    return {mix: build_model(config(mix), seed=1) for mix in MIXES}


def make_llm(model: HybridModel, caching: bool, **kw: object) -> LLM:
    args = dict(device="cpu", block_size=BS, max_num_seqs=16, max_num_batched_tokens=32, kv_cache_memory=2 << 20,
                enable_prefix_caching=caching)
    return LLM(model, **(args | kw))  # type: ignore[arg-type]


def aligned(n: int) -> int:
    return n // BS * BS


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


Run = tuple[list[list[int]], int, int, int]       # outputs, hit tokens, reusable tokens, steps


def shared(llm: LLM, rng: np.random.Generator, *, random_unique: bool) -> Run:
    prefix = rng.integers(1, VOCAB, 37).tolist()                       # not a multiple of BS
    prompts = [prefix + rng.integers(1, VOCAB, int(rng.integers(1, 17)) if random_unique else 5).tolist()
               for _ in range(10)]
    outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    s = llm.stats()
    return outs, s.prefix_hit_tokens, 9 * aligned(37), s.steps


def repeat(llm: LLM, rng: np.random.Generator) -> Run:
    prompts = [rng.integers(1, VOCAB, int(rng.integers(6, 60))).tolist() for _ in range(8)]
    first = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    before = llm.stats()
    again = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    s = llm.stats()
    return first + again, s.prefix_hit_tokens - before.prefix_hit_tokens, sum(aligned(len(p) - 1) for p in prompts), \
        s.steps - before.steps


def chat(llm: LLM, rng: np.random.Generator) -> Run:
    convs = [rng.integers(1, VOCAB, int(rng.integers(6, 30))).tolist() for _ in range(6)]
    outs: list[list[int]] = []
    reusable = hits = 0
    for turn in range(3):
        before = llm.stats().prefix_hit_tokens
        answers = tokens(llm.generate(convs, GREEDY, use_tqdm=False))
        if turn:
            hits += llm.stats().prefix_hit_tokens - before
        outs += answers
        if turn < 2:
            reusable += sum(aligned(len(c) + len(a) - 1) for c, a in zip(convs, answers, strict=True))
            convs = [c + a + rng.integers(1, VOCAB, int(rng.integers(2, 9))).tolist()
                     for c, a in zip(convs, answers, strict=True)]
    return outs, hits, reusable, llm.stats().steps


def mixed(llm: LLM, rng: np.random.Generator) -> Run:
    prompts = [rng.integers(1, VOCAB, int(rng.integers(6, 60))).tolist() for _ in range(8)]
    outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    s = llm.stats()
    return outs, s.prefix_hit_tokens, 0, s.steps


WORKLOADS: dict[str, Callable[[LLM, np.random.Generator], Run]] = {
    "shared": lambda llm, rng: shared(llm, rng, random_unique=False),
    "shared_random_unique": lambda llm, rng: shared(llm, rng, random_unique=True),
    "repeat": repeat,
    "chat": chat,
    "mixed": mixed,
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("mix", ["mamba", "sliding", "short_conv", *(pytest.param(m, marks=pytest.mark.slow)
                                                                       for m in ("mamba2", "chunked",
                                                                                 "gated_deltanet"))])
def test_traffic_hits_and_equals_caching_off(models, mix: str, workload: str) -> None:
    runs = {caching: WORKLOADS[workload](make_llm(models[mix], caching), np.random.default_rng(7))
            for caching in (True, False)}
    (on, hits, reusable, steps_on), (off, hits_off, _, steps_off) = runs[True], runs[False]
    assert on == off
    assert hits_off == 0
    if workload == "mixed":
        assert hits == 0 and steps_on <= steps_off + 1        # a prompt's last partial block runs a step later
    else:
        assert hits >= 0.9 * reusable, f"{mix} {workload}: {hits} of {reusable} reusable tokens hit"
        assert steps_on < steps_off


@pytest.mark.parametrize("mix", MIXES)
def test_requests_sharing_a_prefix_join_as_soon_as_it_is_cached(models, mix: str) -> None:
    """One request computes the shared prefix; every other one joins at the next step, all at once. With
    Mamba layers its chunk ends where they diverge (the state is checkpointed there); attention blocks are
    registered at every boundary, so without them it runs its whole prompt."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, VOCAB, 37).tolist()
    llm = make_llm(models[mix], True, max_num_batched_tokens=64)
    engine = llm.engine
    for i in range(10):
        engine.add_request(str(i), prefix + rng.integers(1, VOCAB, 3).tolist(), GREEDY)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["0"]
    assert engine.coordinator.num_computed_tokens("0") == (aligned(37) if llm.plan.mamba_groups else 40)
    engine.step()
    assert len(engine.scheduler.running) == 10 and not engine.scheduler.waiting
    assert llm.stats().prefix_hit_tokens == 9 * aligned(37)
    while engine.has_unfinished:
        engine.step()


@pytest.mark.parametrize(("mix", "times"), [("mamba", 2), ("sliding", 1.5), ("chunked", 2)])  # Mamba2 holds no blocks
def test_a_workload_larger_than_the_kv_budget_preempts_and_finishes(models, mix: str, times: float) -> None:
    """A budget a few times the smallest that plans one request: admitted requests outgrow it while decoding,
    the latest arrival is preempted (its checkpoints and cached blocks stay findable) and recomputed."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(1, VOCAB, 21).tolist()
    prompts = [prefix + rng.integers(1, VOCAB, int(rng.integers(2, 12))).tolist() for _ in range(6)]
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = tokens(make_llm(models[mix], False, max_model_len=64).generate(prompts, long, use_tqdm=False))
    budget = make_llm(models[mix], True, max_model_len=64).plan.bytes_per_request_max
    while True:                                   # the smallest budget (in 10% steps) that plans one request
        try:
            make_llm(models[mix], True, max_model_len=64, kv_cache_memory=budget)
            break
        except ValueError:
            budget = budget * 11 // 10
    llm = make_llm(models[mix], True, max_model_len=64, kv_cache_memory=int(times * budget))
    assert tokens(llm.generate(prompts, long, use_tqdm=False)) == roomy
    assert llm.stats().preemptions > 0 and llm.stats().prefix_hit_tokens > 0
    coord = llm.engine.coordinator
    assert coord.num_requests == 0 and (coord.state is None or not coord.state._wanted) and len(coord.sharing) == 0
    assert coord.num_free_blocks == llm.plan.num_blocks - 1


def test_too_few_checkpoint_slots_degrade_hits_not_outputs(models, caplog) -> None:
    """The same repeat traffic with 3 checkpoint slots instead of the planned number: fewer hits, the same
    tokens, and one log line."""
    model = models["mamba"]
    rng_state = np.random.default_rng(11)
    prompts = [rng_state.integers(1, VOCAB, int(rng_state.integers(10, 50))).tolist() for _ in range(8)]
    results = {}
    for slots in (None, 3):
        llm = make_llm(model, True)
        if slots is not None:
            plan = dataclasses.replace(llm.plan, num_checkpoint_slots=slots,
                                       num_state_slots=llm.plan.num_state_slots - llm.plan.num_checkpoint_slots + slots)
            llm.engine = LLMEngine(model, plan, max_num_seqs=16, max_num_batched_tokens=32, backend="torch")
            llm.front = EngineFront(llm.engine)         # (the new engine's cache is the one the model is bound to)
        with caplog.at_level(logging.WARNING, logger="hybridkv.kv_groups"):
            caplog.clear()
            outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) + \
                tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
            logged = [r for r in caplog.records if "checkpoint slots" in r.getMessage()]
        results[slots] = (outs, llm.stats().prefix_hit_tokens, len(logged), llm.engine.coordinator.checkpoint_stats())
    (outs_full, hits_full, logs_full, _), (outs_few, hits_few, logs_few, stats_few) = results[None], results[3]
    assert outs_few == outs_full
    assert hits_full >= 0.9 * sum(aligned(len(p) - 1) for p in prompts)
    assert 0 < hits_few < hits_full
    assert logs_full == 0 and logs_few == 1
    assert stats_few.slots == 3 and stats_few.evicted + stats_few.refused > 0


@pytest.mark.parametrize(("mix", "device"), [("mamba", "cpu"), pytest.param("gated_deltanet", "cpu",
                                                                         marks=pytest.mark.slow),
                                             pytest.param("mamba", "cuda", marks=NEEDS_GPU)])
def test_host_memory_keeps_the_checkpoints_the_device_slots_evict(models, mix: str, device: str) -> None:
    """Repeat traffic with 3 device checkpoint slots and a host tier: the evicted checkpoints move to host memory
    and the repeats hit them there (copied back into the working slots), as with the planned device slots."""
    model = models[mix] if device == "cpu" else build_model(config(mix), seed=1).to(device)
    rng_state = np.random.default_rng(11)
    prompts = [rng_state.integers(1, VOCAB, int(rng_state.integers(10, 50))).tolist() for _ in range(8)]
    want = tokens(make_llm(model, False, device=device).generate(prompts, GREEDY, use_tqdm=False)) * 2
    llm = make_llm(model, True, device=device)
    plan = dataclasses.replace(llm.plan, num_checkpoint_slots=3, num_host_checkpoint_slots=16, num_staging_slots=2,
                               num_state_slots=llm.plan.num_state_slots - llm.plan.num_checkpoint_slots + 3)
    llm.engine = LLMEngine(model, plan, max_num_seqs=16, max_num_batched_tokens=32, backend="torch")
    llm.front = EngineFront(llm.engine)
    outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    before = llm.stats().prefix_hit_tokens
    outs += tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.engine.coordinator.checkpoint_stats()
    assert outs == want
    assert llm.stats().prefix_hit_tokens - before >= 0.9 * sum(aligned(len(p) - 1) for p in prompts)
    assert stats.slots == 3 and stats.host_slots == 16 and stats.demoted > 0 and stats.host_stored > 0
    # none lost for room; on a GPU a few may be lost while the one staging row's copy out is in flight
    assert stats.evicted == stats.host_busy and (device == "cuda" or stats.host_busy == 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_GPU)])
def test_runner_copies_read_every_source_before_the_batch(models, device: str) -> None:
    """``ModelRunner.copy_states`` with device and host slots in one batch equals copying from a snapshot: a
    device slot moved to host memory and overwritten, a working slot read by a store and refilled from host;
    two staging rows, so three moves each way run in rounds."""
    model = models["mamba"] if device == "cpu" else build_model(config("mamba"), seed=1).to(device)
    plan = dataclasses.replace(make_llm(models["mamba"], True).plan, num_host_checkpoint_slots=6,
                               num_staging_slots=2)
    runner = LLMEngine(model, plan, max_num_seqs=16, max_num_batched_tokens=32, backend="torch").runner
    host, n = runner.host_checkpoints, plan.num_state_slots
    device_states = [t for g in plan.mamba_groups for name in g.layer_names for t in runner.caches[name]]
    gen = torch.Generator().manual_seed(0)
    for t in device_states:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    for j in range(6):
        for t in host.states_of(n + j):
            t.copy_(torch.randn(t.shape, generator=gen))

    def slot(i: int) -> list[torch.Tensor]:
        if device != "cpu":
            torch.cuda.synchronize()
        return [t[i].cpu().clone() for t in device_states] if i < n else [t.clone() for t in host.states_of(i)]

    ckpt, work = n - 1, 1                       # a checkpoint slot and a working slot
    copies = [(ckpt, n), (work, ckpt), (n + 1, work), (n + 2, 2), (n - 2, n + 3), (3, n + 4), (n + 5, 4)]
    want = {d: slot(s) for s, d in copies}
    runner.copy_states(copies)
    for d, tensors in want.items():
        for got, expected in zip(slot(d), tensors, strict=True):
            assert torch.equal(got, expected)
    # the next batch reads at once what a copy out of the last one is still writing (no sync between them)
    for _ in range(3):
        want = slot(n - 2)
        runner.copy_states([(n - 2, n + 5)])
        runner.copy_states([(n + 5, 1)])
        assert all(torch.equal(got, expected) for got, expected in zip(slot(1), want, strict=True))
        device_states[0][n - 2] += 1
    assert device == "cpu" or host.host.is_pinned()
    with pytest.raises(RuntimeError, match="host -> host"):
        runner.copy_states([(n, n + 1)])


def test_host_cache_memory_sizes_the_host_tier(models) -> None:
    state_bytes = make_llm(models["mamba"], True).plan.state_bytes_per_slot
    plan = make_llm(models["mamba"], True, host_cache_memory=10 * state_bytes + 1).plan
    assert plan.num_host_checkpoint_slots == 10 and plan.host_checkpoint_bytes == 10 * state_bytes
    assert "10 checkpoint slots in host memory" in plan.summary()
    assert plan.allocated_bytes <= plan.budget_bytes                  # not part of the device budget
    assert make_llm(models["mamba"], False, host_cache_memory=1 << 20).plan.num_host_checkpoint_slots == 0
    assert make_llm(models["sliding"], True, host_cache_memory=1 << 20).plan.num_host_checkpoint_slots == 0
    with pytest.raises(ValueError, match="host_cache_memory"):
        make_llm(models["mamba"], True, host_cache_memory="-1GiB")


def test_plan_shows_the_checkpoint_memory(models) -> None:
    llm = make_llm(models["mamba"], True)
    plan = llm.plan
    assert plan.num_checkpoint_slots == 2 * 16                  # two per sequence: prompt end, answer end
    assert plan.checkpoint_bytes == plan.num_checkpoint_slots * plan.state_bytes_per_slot
    assert plan.checkpoint_bytes <= plan.budget_bytes // 3
    assert f"{plan.num_checkpoint_slots} for prefix-cache checkpoints" in plan.summary()
    assert make_llm(models["mamba"], False).plan.num_checkpoint_slots == 0
    assert make_llm(models["sliding"], True).plan.num_checkpoint_slots == 0


def test_per_group_hit_stats(models) -> None:
    """Each group counts the prefix it alone holds; the hybrid hit is the longest they all accept."""
    llm = make_llm(models["mamba"], True)
    rng = np.random.default_rng(2)
    p = rng.integers(1, VOCAB, 30).tolist()
    llm.generate([p], GREEDY, use_tqdm=False)
    llm.generate([p], GREEDY, use_tqdm=False)
    stats = llm.engine.coordinator.group_stats()
    assert set(stats) == {g.group_id for g in llm.plan.groups}
    total = llm.stats()
    for s in stats.values():
        assert s.queries == 2 and s.query_tokens == 60
        assert s.hit_tokens >= total.prefix_hit_tokens == aligned(29)

"""``prefill_spread``: while requests decode, a step's prompt tokens are capped at max(``PREFILL_FLOOR``, pending /
spread), so a burst of prompts runs over several steps instead of stretching the decodes' next token.

Table-driven cap, the worked example below, a brute-force oracle of every step's token count (``hypothesis``), and
the end-to-end invariant: the same greedy tokens with and without spreading, through preemption and aborts.

Budget 64, spread 4, floor 8: two requests decode (d) when three 40-token prompts (A, B, C) arrive; pending is
what the running prefills and the waiting prompts still have to compute.

    step  decodes  pending  cap = decodes + max(8, ceil(pending / 4))   scheduled
    1     2        120      2 + 30                                     d d A30
    2     2         90      2 + 23                                     d d A10 B13     (A's first token)
    3     3         67      3 + 17                                     d d a B17
    4     3         50      3 + 13                                     d d a B10 C3    (B's first token)
    5     4         37      4 + 10                                     d d a b C10
Without spreading, step 1 would be d d A40 B22 and step 2 d d a B18 C40 (64 tokens each).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import LLM, SamplingParams
from hybridkv.engine import scheduler as scheduler_module
from hybridkv.engine.config import EngineConfig
from hybridkv.models import MLP, Attention, HybridConfig, Layer

VOCAB = 61


def attention_config() -> HybridConfig:
    layer = Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16), ffn=MLP(intermediate_size=32))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=(layer, layer), max_position_embeddings=256,
                        dtype="float32")


def make_llm(*, budget: int = 64, spread: int = 4, max_num_seqs: int = 32, memory: int = 4 << 20,
             prefix_caching: bool = False) -> LLM:
    return LLM(attention_config(), device="cpu", block_size=4, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, prefill_spread=spread, kv_cache_memory=memory,
               enable_prefix_caching=prefix_caching)


def check_queue(sched: scheduler_module.Scheduler) -> None:
    """The waiting tokens' running count is the waiting requests' counts at entry."""
    assert set(sched._queued) == set(sched.waiting)
    assert sched._queued_tokens == sum(sched._queued.values())


@pytest.mark.parametrize(("budget", "spread", "rem", "queued", "expected"), [
    (64, 4, [5, 30], 0, 64),              # nobody decodes: the budget
    (64, 1, [1, 1, 30], 100, 64),         # spread 1: the budget
    (64, 4, [1, 1], 0, 2 + 8),            # decodes only, nothing pending: the floor
    (64, 4, [1, 1, 30], 100, 2 + 33),     # pending 130 over 4 steps
    (64, 4, [1, 1, 0], 10, 2 + 8),        # (a request whose last token is on its way counts for nothing)
    (64, 4, [1] * 3, 400, 64),            # a long queue: the budget
    (64, 4, [1] * 70, 400, 64),           # more decodes than the budget: the budget
])
def test_the_cap(budget: int, spread: int, rem: list[int], queued: int, expected: int,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "PREFILL_FLOOR", 8)
    sched = make_llm(budget=budget, spread=spread).engine.scheduler
    sched._queued_tokens = queued
    assert sched._spread(budget, np.asarray(rem, np.int64)) == expected


def test_the_worked_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module docstring's diagram, step by step."""
    monkeypatch.setattr(scheduler_module, "PREFILL_FLOOR", 8)
    eng = make_llm().engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for rid in ("d1", "d2"):
        eng.add_request(rid, [3, 4, 5], params)
    eng.step()                                      # their prompts: both decode from here
    for rid in "ABC":
        eng.add_request(rid, list(range(1, 41)), params)
    seen = []
    schedule = eng.scheduler.schedule

    def recorded():
        batch = schedule()
        seen.append([(r.request_id, int(n)) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)])
        return batch

    eng.scheduler.schedule = recorded
    for _ in range(5):
        eng.step()
    d = [("d1", 1), ("d2", 1)]
    assert seen == [d + [("A", 30)], d + [("A", 10), ("B", 13)], d + [("A", 1), ("B", 17)],
                    d + [("A", 1), ("B", 10), ("C", 3)], d + [("A", 1), ("B", 1), ("C", 10)]]
    while eng.has_unfinished:
        eng.step()


def _brute_force_cap(eng, spread: int, floor: int) -> tuple[int, int, int]:
    """(the step's token cap, its decodes, all tokens it could compute) from every request's state."""
    sched, coord = eng.scheduler, eng.coordinator
    budget = sched.config.max_num_batched_tokens
    decodes = pending = 0
    for req in sched.running:
        rem = int(sched.row_num_tokens[req.kv_row]) - coord.num_computed_tokens(req.request_id)
        if sched.row_num_tokens[req.kv_row] >= sched.row_final[req.kv_row]:
            rem = 0
        if rem == 1:
            decodes += 1
        else:
            pending += rem
    pending += sum(req.num_tokens for req in sched.waiting)
    if spread == 1 or not decodes:
        return budget, decodes, decodes + pending
    return min(budget, decodes + max(floor, math.ceil(pending / spread))), decodes, decodes + pending


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), spread=st.sampled_from([1, 2, 3, 8]), floor=st.integers(1, 24),
       budget=st.sampled_from([16, 40, 96]))
def test_every_step_takes_what_the_brute_force_cap_allows(seed: int, spread: int, floor: int, budget: int) -> None:
    """Each step computes min(cap, what there is) tokens, the cap as the module docstring computes it from every
    request's state (plenty of memory and sequences: nothing else limits it); the queue's count stays exact."""
    scheduler_module.PREFILL_FLOOR, saved = floor, scheduler_module.PREFILL_FLOOR
    try:
        rng = np.random.default_rng(seed)
        eng = make_llm(budget=budget, spread=spread, max_num_seqs=64, memory=16 << 20).engine
        schedule = eng.scheduler.schedule
        checked = []

        def checked_schedule():
            cap, decodes, available = _brute_force_cap(eng, spread, floor)
            batch = schedule()
            assert not batch.preempted
            assert batch.num_tokens == min(cap, available), (cap, decodes, available)
            checked.append(decodes > 0 and cap < min(budget, available))
            return batch

        eng.scheduler.schedule = checked_schedule
        n = 0
        for _ in range(40):
            for _ in range(int(rng.poisson(0.6))):
                prompt = rng.integers(1, VOCAB, int(rng.integers(1, 60))).tolist()
                eng.add_request(f"r{n}", prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 12)),
                                                                ignore_eos=True))
                n += 1
            check_queue(eng.scheduler)
            if eng.has_unfinished:
                eng.step()
        while eng.has_unfinished:
            eng.step()
        check_queue(eng.scheduler)
        assert eng.scheduler._queued_tokens == 0
    finally:
        scheduler_module.PREFILL_FLOOR = saved


def test_spreading_changes_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens with spreading equal those without, with prefix hits, preemption (tight memory) and an abort
    of a waiting request on the way; everything is freed and the queue's count is back to 0."""
    monkeypatch.setattr(scheduler_module, "PREFILL_FLOOR", 4)
    rng = np.random.default_rng(1)
    prefix = rng.integers(1, VOCAB, 12).tolist()
    prompts = [prefix + rng.integers(1, VOCAB, int(rng.integers(1, 40))).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = []
    for spread in (1, 3):
        llm = make_llm(budget=48, spread=spread, max_num_seqs=8, memory=72 << 10, prefix_caching=True)
        eng = llm.engine
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts[:4]):
            eng.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        for i, prompt in enumerate(prompts[4:], start=4):
            eng.add_request(f"r{i}", prompt, params)
        assert "r9" in {r.request_id for r in eng.scheduler.waiting}
        eng.abort("r9")
        check_queue(eng.scheduler)
        while eng.has_unfinished:
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            check_queue(eng.scheduler)
        assert eng.scheduler._queued_tokens == 0 and eng.coordinator.num_requests == 0
        runs.append((out, eng.scheduler.num_preemptions))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] > 0                   # (the tight memory did preempt)


def test_the_setting_is_validated_and_reaches_the_scheduler() -> None:
    with pytest.raises(ValueError, match="prefill_spread must be a positive int"):
        EngineConfig(prefill_spread=0)
    assert make_llm(spread=5).engine.scheduler.config.prefill_spread == 5
    assert EngineConfig().prefill_spread == 8

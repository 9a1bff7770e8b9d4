"""``prefill_spread``: while requests decode, a step's prompt tokens are capped at max(``prefill_floor``, pending /
spread) (the step rounded up to the runner's next step size, when it has any), so a burst of prompts runs over
several steps instead of stretching the decodes' next token.

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
Without spreading (``prefill_spread`` 1, or no request streams: outputs only at the end), step 1 would be
d d A40 B22 and step 2 d d a B18 C40. A runner that pads a step to one of a few sizes (``step_sizes``: its graphs'
buckets) has the cap rounded up to the next of them (with sizes 16, 40, 64, step 1's cap of 32 becomes 40: d d A38).
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
from hybridkv.engine.model_runner import reference_logits
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2

VOCAB = 61


def tiny_config(mamba: bool = False) -> HybridConfig:
    """Two attention layers, or a Mamba2 layer and an attention layer (prefill chunks aligned with prefix caching)."""
    attention = Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16), ffn=MLP(intermediate_size=32))
    first = Layer(mixer=Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
                  ffn=MLP(intermediate_size=32)) if mamba else attention
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=(first, attention), max_position_embeddings=256,
                        dtype="float32")


def make_llm(*, budget: int = 64, spread: int = 4, floor: int = 8, max_num_seqs: int = 32, memory: int = 4 << 20,
             prefix_caching: bool = False, mamba: bool = False, async_scheduling: bool = False) -> LLM:
    return LLM(tiny_config(mamba), device="cpu", block_size=4, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, prefill_spread=spread, prefill_floor=floor, kv_cache_memory=memory,
               enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)


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
    (64, 4, ["tail", "tail", 30], 100, 64),   # prompts' one-token tails are no decodes: the budget
    (64, 4, [1, "tail", 30], 100, 1 + 33),    # ... but pending (131 over 4 steps)
])
def test_the_cap(budget: int, spread: int, rem: list, queued: int, expected: int) -> None:
    sched = make_llm(budget=budget, spread=spread).engine.scheduler
    sched._queued_tokens = queued
    generating = np.asarray([r != "tail" for r in rem])
    rem = np.asarray([1 if r == "tail" else r for r in rem], np.int64)
    assert sched._spread(budget, rem, generating) == expected
    sched._queued_tokens = 0


@pytest.mark.parametrize(("rem", "queued", "sizes", "expected"), [
    ([1, 1, 30], 100, (16, 32, 48, 64), 48),    # 2 + 33 = 35: the 48-token size's padding takes prompt tokens
    ([1, 1], 0, (16, 32), 16),                  # the floor's 2 + 8 rounded up
    ([1, 1, 30], 100, (16, 32), 35),            # past the largest size: as it was
    ([1, 1, 30], 100, (16, 35, 40), 35),        # a size met exactly
    ([1] * 3, 400, (16, 32, 48, 64, 96), 64),   # the budget caps it still
    ([1, 1, 30], 100, (16, 96), 64),            # ... and a size past the budget
    ([5, 30], 0, (16, 32), 64),                 # nobody decodes: the budget
])
def test_the_cap_rounds_up_to_the_runners_step_sizes(rem: list, queued: int, sizes: tuple, expected: int) -> None:
    sched = make_llm(budget=64, spread=4).engine.scheduler
    assert sched.step_sizes.size == 0                   # (the CPU runner pads no step)
    sched.step_sizes, sched._queued_tokens = np.asarray(sizes), queued
    rem = np.asarray(rem, np.int64)
    assert sched._spread(64, rem, np.ones(rem.size, bool)) == expected
    sched._queued_tokens = 0


def test_the_engine_gives_the_scheduler_its_runners_step_sizes() -> None:
    """The sizes come from the runner's mixed graphs (their buckets); a runner without them gives none."""
    from types import SimpleNamespace

    import torch

    from hybridkv.engine.engine import LLMEngine

    llm = make_llm()
    for graphs, want in ((SimpleNamespace(buckets=(16, 32, 64)), [16, 32, 64]), (None, [])):
        runner = SimpleNamespace(mixed_graphs=graphs, device=torch.device("cpu"))
        eng = LLMEngine(llm.engine.model, llm.plan, max_num_seqs=8, max_num_batched_tokens=64, runner=runner)
        assert eng.scheduler.step_sizes.tolist() == want


@pytest.mark.parametrize("streamed", [True, False])
def test_the_worked_example(streamed: bool) -> None:
    """The module docstring's diagram, step by step; without a streamed request (outputs only at the end, as
    ``LLM.generate`` asks) the steps take their whole budget."""
    from hybridkv.engine.request import OutputKind

    eng = make_llm().engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kind = OutputKind.DELTA if streamed else OutputKind.FINAL
    for rid in ("d1", "d2"):
        eng.add_request(rid, [3, 4, 5], params, output_kind=kind)
    eng.step()                                      # their prompts: both decode from here
    for rid in "ABC":
        eng.add_request(rid, list(range(1, 41)), params, output_kind=kind)
    seen = []
    schedule = eng.scheduler.schedule

    def recorded(**kw):
        batch = schedule(**kw)
        seen.append([(r.request_id, int(n)) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)])
        return batch

    eng.scheduler.schedule = recorded
    for _ in range(5 if streamed else 2):
        eng.step()
    d = [("d1", 1), ("d2", 1)]
    if streamed:
        assert seen == [d + [("A", 30)], d + [("A", 10), ("B", 13)], d + [("A", 1), ("B", 17)],
                        d + [("A", 1), ("B", 10), ("C", 3)], d + [("A", 1), ("B", 1), ("C", 10)]]
    else:
        assert seen == [d + [("A", 40), ("B", 22)], d + [("A", 1), ("B", 18), ("C", 40)]]
    while eng.has_unfinished:
        eng.step()


def _brute_force_cap(eng, spread: int, floor: int, sizes: tuple[int, ...]) -> tuple[int, int, int]:
    """(the step's token cap, its decodes, all tokens it could compute) from every request's state."""
    sched, coord = eng.scheduler, eng.coordinator
    budget = sched.config.max_num_batched_tokens
    decodes = pending = 0
    for req in sched.running:
        rem = int(sched.row_num_tokens[req.kv_row]) - coord.num_computed_tokens(req.request_id)
        if sched.row_num_tokens[req.kv_row] >= sched.row_final[req.kv_row]:
            rem = 0
        if rem == 1 and req.num_tokens > req.num_prompt_tokens:      # (a prompt's last token is no decode)
            decodes += 1
        else:
            pending += rem
    pending += sum(req.num_tokens for req in sched.waiting)
    if spread == 1 or not decodes:
        return budget, decodes, decodes + pending
    cap = decodes + max(floor, math.ceil(pending / spread))
    cap = min([s for s in sizes if s >= cap], default=cap)
    return min(budget, cap), decodes, decodes + pending


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), spread=st.sampled_from([1, 2, 3, 8]), floor=st.integers(1, 24),
       budget=st.sampled_from([16, 40, 96]), sizes=st.sampled_from([(), (8, 16, 24, 32, 48), (20, 64)]))
def test_every_step_takes_what_the_brute_force_cap_allows(seed: int, spread: int, floor: int, budget: int,
                                                           sizes: tuple[int, ...]) -> None:
    """Each step computes min(cap, what there is) tokens, the cap as the module docstring computes it from every
    request's state (plenty of memory and sequences: nothing else limits it), rounded up to the runner's step
    sizes when it has any; the queue's count stays exact."""
    rng = np.random.default_rng(seed)
    eng = make_llm(budget=budget, spread=spread, floor=floor, max_num_seqs=64, memory=16 << 20).engine
    eng.scheduler.step_sizes = np.asarray(sizes, np.int64)
    schedule = eng.scheduler.schedule

    def checked_schedule(**kw):
        assert kw == {"spread": True}                   # (every request streams)
        cap, decodes, available = _brute_force_cap(eng, spread, floor, sizes)
        batch = schedule(**kw)
        assert not batch.preempted
        assert batch.num_tokens == min(cap, available), (cap, decodes, available)
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


@pytest.mark.parametrize(("mamba", "memory", "asynchronous"),
                         [(False, 72 << 10, False), (True, 80 << 10, False), (False, 72 << 10, True)])
def test_spreading_changes_no_token(mamba: bool, memory: int, asynchronous: bool) -> None:
    """Greedy tokens with spreading are the no-cache reference's, as without it, through prefix hits, preemption
    (tight memory) and an abort of a waiting request, with a Mamba2 layer (chunks aligned for its checkpoints) and
    with asynchronous scheduling (a request's last token still on its way); everything is freed and the queue's
    count is back to 0."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(1, VOCAB, 12).tolist()
    prompts = [prefix + rng.integers(1, VOCAB, int(rng.integers(1, 40))).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for spread in (1, 3):
        llm = make_llm(budget=48, spread=spread, floor=4, max_num_seqs=8, memory=memory, prefix_caching=True,
                       mamba=mamba, async_scheduling=asynchronous)
        eng = llm.engine
        capped = []
        spread_cap = eng.scheduler._spread

        def counted(budget, rem, generating, spread_cap=spread_cap, capped=capped):
            cap = spread_cap(budget, rem, generating)
            capped.append(cap < budget)
            return cap

        eng.scheduler._spread = counted
        final: dict[str, list[int]] = {}

        def step(eng=eng, final=final) -> None:
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = list(o.outputs[0].token_ids)
            check_queue(eng.scheduler)

        for i, prompt in enumerate(prompts[:4]):
            eng.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            step()
        for i, prompt in enumerate(prompts[4:], start=4):
            eng.add_request(f"r{i}", prompt, params)
        assert "r9" in {r.request_id for r in eng.scheduler.waiting}
        eng.abort("r9")
        check_queue(eng.scheduler)
        while eng.has_unfinished:
            step()
        assert eng.scheduler._queued_tokens == 0 and eng.coordinator.num_requests == 0
        assert eng.scheduler.num_preemptions > 0              # (the tight memory did preempt)
        assert any(capped) == (spread > 1)
        for i, prompt in enumerate(prompts[:9]):
            seq = list(prompt)
            for _ in range(params.max_tokens):
                seq.append(int(reference_logits(eng.model, seq)[-1].argmax()))
            assert final[f"r{i}"] == seq[len(prompt):], (spread, i)


def test_the_settings_are_validated_and_reach_the_scheduler() -> None:
    from hybridkv.cli import build_parser
    from hybridkv.server.cli import engine_config

    for name in ("prefill_spread", "prefill_floor"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            EngineConfig(**{name: 0})
        with pytest.raises(ValueError, match=f"SchedulerConfig.{name} must be positive"):
            scheduler_module.SchedulerConfig(**{name: 0})
    config = make_llm(spread=5, floor=7).engine.scheduler.config
    assert (config.prefill_spread, config.prefill_floor) == (5, 7)
    assert EngineConfig().prefill_spread == scheduler_module.DEFAULT_PREFILL_SPREAD == 8
    assert EngineConfig().prefill_floor == scheduler_module.DEFAULT_PREFILL_FLOOR == 192
    parser = build_parser()
    config = engine_config(parser.parse_args(["serve", "m", "--prefill-spread", "3", "--prefill-floor", "64"]))
    assert (config.prefill_spread, config.prefill_floor) == (3, 64)
    config = engine_config(parser.parse_args(["serve", "m"]))
    assert (config.prefill_spread, config.prefill_floor) == (8, 192)

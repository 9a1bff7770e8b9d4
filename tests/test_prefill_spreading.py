"""Prefill spreading (``SchedulerConfig.prefill_spread_steps``): while requests decode, a step takes their decodes
plus 1/N of the pending prompt tokens (at least ``spread_min_chunk``), not its whole budget.

    N = 4, min chunk 2, budget 64; two requests decoding (d), 20 prompt tokens pending (a 12-token prefill
    continuing, an 8-token prompt waiting):
    spreading off:  | d d p p p p p p p p p p p p w w w w w w w w |   22 tokens, one long step
    spreading on:   | d d p p p p p |  then 4, 3, 3, ... prompt tokens a step beside the decodes

Units: the budget for a table of queues. Oracle: the token machine of ``test_prefix_scheduling_oracle`` (every key
and state checked every step) under staggered arrivals, against a brute-force bound on each step's prompt tokens;
outputs equal those without spreading. End to end: a real tiny model's greedy tokens are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import SamplingParams
from hybridkv.engine.scheduler import SPREAD_SCAN, Scheduler, SchedulerConfig
from tests.test_prefix_scheduling_oracle import MIXES, VOCAB, make_engine


def _scheduler(steps: int, min_chunk: int, waiting: list[int]) -> Scheduler:
    coord = SimpleNamespace(max_num_reqs=8, state=None, block_size=16)
    s = Scheduler(SchedulerConfig(prefill_spread_steps=steps, spread_min_chunk=min_chunk), coord)  # type: ignore[arg-type]
    s.waiting.extend(SimpleNamespace(num_tokens=n) for n in waiting)
    return s


@pytest.mark.parametrize(("steps", "min_chunk", "budget", "rem", "waiting", "want"), [
    (4, 2, 64, [1, 1, 12], [8], 2 + 5),             # the diagram: 20 pending / 4
    (8, 64, 2048, [300], [260], 2048),              # nothing decodes: the whole budget
    (8, 64, 2048, [1, 1, 1], [], 3 + 64),           # decodes only: room for the least chunk
    (8, 64, 2048, [1, 1, 300], [260], 2 + 70),      # 560 pending / 8
    (8, 64, 2048, [0, 1], [], 1 + 64),              # a finished row (0) is no decode
    (8, 64, 2048, [1] * 4, [4000] * 10, 2048),      # a long queue's share past the budget
    (8, 64, 100, [1] * 40, [], 100),                # never past the budget
    (8, 64, 2048, [1], [1] * (SPREAD_SCAN + 1), 2048),   # too many waiting to count: the whole budget
])
def test_the_budget_spreads_what_is_pending(steps, min_chunk, budget, rem, waiting, want) -> None:
    assert _scheduler(steps, min_chunk, waiting)._spread(budget, np.asarray(rem, np.int64)) == want


@pytest.mark.parametrize("bad", [dict(prefill_spread_steps=-1), dict(spread_min_chunk=0)])
def test_bad_spreading_config_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="prefill_spread_steps"):
        SchedulerConfig(**bad)


def _run_staggered(mix: str, seed: int, *, steps: int, min_chunk: int, budget: int, bs: int) -> dict[str, list[int]]:
    """Requests arriving over the steps of a token-machine engine; with spreading on, every step's prompt tokens
    are checked against the bound computed by brute force from the requests before it."""
    rng = random.Random(seed)
    engine, _ = make_engine(MIXES[mix](bs, 2), caching=rng.random() < 0.5, budget=budget)
    sched = engine.scheduler
    sched.config = dataclasses.replace(sched.config, prefill_spread_steps=steps, spread_min_chunk=min_chunk)
    arrivals = [(rng.randint(0, 30), f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 60))],
                 rng.randint(1, 12)) for i in range(rng.randint(2, 10))]
    schedule, checked = sched.schedule, []

    def bounded():
        # brute force: each request's tokens to compute, from the request objects and the coordinator
        todo = {r.request_id: r.num_tokens - engine.coordinator.num_computed_tokens(r.request_id)
                for r in sched.running}
        decodes = sum(1 for n in todo.values() if n == 1)
        pending = sum(n for n in todo.values() if n > 1) + sum(r.num_tokens for r in sched.waiting)
        batch = schedule()
        if steps and decodes and len(sched.waiting) + batch.num_reqs <= SPREAD_SCAN:
            prompt = batch.num_tokens - int(np.count_nonzero(batch.num_new_tokens == 1))
            assert prompt <= max(min_chunk, math.ceil(pending / steps)), (prompt, pending, decodes)
            checked.append(prompt)
        return batch

    sched.schedule = bounded                                    # type: ignore[method-assign]
    outs: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished:
        for a in [a for a in arrivals if a[0] <= step]:
            engine.add_request(a[1], a[2], SamplingParams(temperature=0.0, max_tokens=a[3], ignore_eos=True))
            arrivals.remove(a)
        for o in engine.step(only_finished=True):
            outs[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    c = engine.coordinator
    c.check_invariants()
    assert c.num_requests == 0
    return outs


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seed", range(3))
def test_spreading_changes_no_output_and_bounds_every_step(mix: str, seed: int) -> None:
    kw = dict(budget=32, bs=2)
    assert _run_staggered(mix, seed, steps=3, min_chunk=2, **kw) == _run_staggered(mix, seed, steps=0, min_chunk=2,
                                                                                    **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=st.sampled_from(sorted(MIXES)), seed=st.integers(0, 10**6), steps=st.integers(1, 9),
       min_chunk=st.integers(1, 8), budget=st.integers(1, 48), bs=st.sampled_from([1, 2, 4]))
def test_spreading_changes_no_output_and_bounds_every_step_hypothesis(mix, seed, steps, min_chunk, budget, bs) -> None:
    kw = dict(min_chunk=min_chunk, budget=budget, bs=bs)
    assert _run_staggered(mix, seed, steps=steps, **kw) == _run_staggered(mix, seed, steps=0, **kw)


def test_a_prompt_beside_decodes_rides_in_short_steps() -> None:
    """Two requests decoding, then a 40-token prompt: off, one step takes all of it; on (N = 4, min 2), chunks of
    ceil(pending / 4), at least 2."""
    chunks = {}
    for steps in (0, 4):
        engine, _ = make_engine(MIXES["sliding"](2, 1), caching=False, budget=64)
        sched = engine.scheduler
        sched.config = dataclasses.replace(sched.config, prefill_spread_steps=steps, spread_min_chunk=2)
        for i in range(2):
            engine.add_request(f"d{i}", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        engine.step()
        engine.add_request("p", list(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        schedule, sizes = sched.schedule, []

        def recording(schedule=schedule, sizes=sizes):
            batch = schedule()
            sizes.append(int(batch.num_new_tokens[batch.num_new_tokens > 1].sum()))
            return batch

        sched.schedule = recording                              # type: ignore[method-assign]
        while "p" not in {o.request_id for o in engine.step(only_finished=True)}:
            pass
        chunks[steps] = list(sizes)
        while engine.has_unfinished:
            engine.step()
    assert chunks[0] == [40]
    assert chunks[4] == [10, 8, 6, 4, 3, 3, 2, 2, 2]

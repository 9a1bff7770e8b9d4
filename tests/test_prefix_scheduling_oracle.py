"""Oracle of prefix caching through the whole scheduler + coordinator, without a model.

A *token machine* stands in for the model runner: it writes (position, token) into every attention KV
slot a step maps, keeps for every Mamba state slot the tokens the state has consumed, applies the state
copies, and checks, for every query token, that each key its kind can see (full: all; sliding window:
the last W; chunked: its chunk) holds exactly the request's token at that position, and that a Mamba
state starting a chunk holds exactly the request's computed prefix. It samples a hash of the sequence, so
outputs never depend on caching; the checks do the work.

Brute force of where hits must land (memory large enough that nothing is evicted), for requests submitted
together in waves:
  * same wave: a request admitted after another one that computed an aligned prefix they share (up to
    both prompts' last block boundaries; long enough to be worth a step, ``STOP_MIN_SAVING``) starts from
    that prefix: it was computed once and checkpointed at the divergence;
  * a later wave: a request starts at least from an earlier request's prompt end or prompt + answer end
    (the last aligned length each of them computed) when it extends that sequence: exact repeats and chat
    turns;
and no wave computes more prompt tokens with caching than without.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import SamplingParams
from hybridkv.engine.engine import LLMEngine, RequestError
from hybridkv.engine.model_runner import StepBatch, StepOutput
from hybridkv.engine.scheduler import STOP_MIN_SAVING
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from tests._kv_helpers import chunked, full, mamba, sliding, small_plan

VOCAB = 1000


class TokenMachine:
    """A ``StepRunner`` without a model (see the module docstring). ``engine`` is set after construction."""

    def __init__(self, plan: KVCachePlan) -> None:
        self.plan = plan
        self.device = torch.device("cpu")
        self.engine: OracleEngine | None = None
        self.kv: list[dict[int, tuple[int, int]]] = [{} for _ in plan.groups]
        self.states: dict[int, tuple[int, ...] | None] = {}
        self.copies = 0

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        values = [self.states.get(src) for src, _ in copies]
        for (_, dst), value in zip(copies, values, strict=True):
            self.states[dst] = value
        self.copies += len(copies)

    def host_moves_available(self) -> int:
        return 1 << 30

    def _visible(self, spec: KVCacheSpec, pos: int) -> range:
        if isinstance(spec, SlidingWindowSpec):
            return range(max(0, pos - spec.sliding_window + 1), pos + 1)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return range(pos // spec.attention_chunk_size * spec.attention_chunk_size, pos + 1)
        return range(pos + 1)

    def execute(self, batch: StepBatch) -> StepOutput:
        assert self.engine is not None
        reqs = self.engine.current.requests
        tables = [np.asarray(batch.block_tables[g]) for g in range(len(self.plan.groups))]
        slots = batch.block_tables.slots                            # type: ignore[attr-defined]
        ends = np.cumsum(batch.query_lens)
        out = []
        for i, req in enumerate(reqs):
            q, seq = int(batch.query_lens[i]), int(batch.seq_lens[i])
            start, first = seq - q, int(ends[i]) - q
            toks = req.token_ids
            assert batch.input_ids[first:first + q].tolist() == toks[start:seq]
            for g, group in enumerate(self.plan.groups):
                spec = group.spec
                if isinstance(spec, MambaSpec):
                    slot = int(tables[g][i, 0])
                    assert slot != 0
                    if start:
                        assert self.states.get(slot) == tuple(toks[:start]), "a state is not its prefix"
                    self.states[slot] = tuple(toks[:seq])
                    continue
                bs = spec.block_size
                for t in range(q):
                    self.kv[g][int(slots[g][first + t])] = (start + t, toks[start + t])
                row = tables[g][i]
                for pos in range(start, seq):
                    for k in self._visible(spec, pos):
                        block = int(row[k // bs])
                        assert block != 0, f"group {g}: key {k} of a query at {pos} has no block"
                        assert self.kv[g].get(block * bs + k % bs) == (k, toks[k]), \
                            f"group {g}: key {k} holds another token"
            out.append(hash(tuple(toks[:seq])) % (VOCAB - 1) + 1)
        sampled = torch.tensor([out[int(j)] for j in self._sampling_rows(batch)], dtype=torch.int64)
        return StepOutput(logits=None, greedy=sampled)

    @staticmethod
    def _sampling_rows(batch: StepBatch) -> list[int]:
        """Request index of every logits row (``logits_indices`` are token indices)."""
        ends = np.cumsum(batch.query_lens)
        return np.searchsorted(ends, batch.logits_indices, side="right").tolist()


class OracleEngine(LLMEngine):
    """The engine, keeping the batch being run where the token machine can read its requests."""

    def _step_batch(self, batch: Any, prev: Any = None) -> Any:
        self.current = batch
        return super()._step_batch(batch, prev)


def make_engine(layers: dict[str, KVCacheSpec], *, caching: bool, budget: int, num_blocks: int = 4000,
                working: int = 12, checkpoints: int = 2000, max_len: int = 256, seqs: int = 12,
                interval: int | None = None) -> tuple[OracleEngine, TokenMachine]:
    plan = small_plan(layers, num_blocks=num_blocks, num_working_slots=working, num_checkpoint_slots=checkpoints,
                      max_model_len=max_len, step_tokens=budget)
    machine = TokenMachine(plan)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB, eos_token_ids=()))
    engine = OracleEngine(model, plan, max_num_seqs=seqs, max_num_batched_tokens=budget,  # type: ignore[arg-type]
                          enable_prefix_caching=caching, runner=machine)
    if interval is not None and engine.coordinator.state is not None:
        engine.coordinator.state.decode_interval = interval
    machine.engine = engine
    hits: dict[str, int] = {}
    find = engine.coordinator.find_prefix_hit

    def recording(request_id: str, token_ids: Any) -> int:
        hits[request_id] = hit = find(request_id, token_ids)
        order.append(request_id)
        return hit

    order: list[str] = []
    engine.coordinator.find_prefix_hit = recording               # type: ignore[method-assign]
    engine.hits, engine.order = hits, order                      # type: ignore[attr-defined]
    return engine, machine


def run_wave(engine: OracleEngine, prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens[rid], ignore_eos=True))
    return drain(engine)


def drain(engine: OracleEngine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step(only_finished=True):
            outs[o.request_id] = list(o.outputs[0].token_ids)
    return outs


def common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


MIXES = {
    "mamba": lambda bs, m: {"f": full(bs), "m": mamba(bs * m)},
    "mamba_only": lambda bs, m: {"m": mamba(bs * m)},
    "sliding": lambda bs, m: {"s": sliding(3 * bs - 1, bs), "f": full(bs)},
    "chunked": lambda bs, m: {"c": chunked(2 * bs, bs), "f": full(bs)},
    "all": lambda bs, m: {"f": full(bs), "s": sliding(2 * bs + 1, bs), "c": chunked(2 * bs, bs), "m": mamba(bs * m)},
}


def workload(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts drawn from a few bases: shared prefixes of random lengths, exact duplicates, unique ones."""
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(rng.randint(1, 3))]
    out = []
    for _ in range(n):
        base = rng.choice(bases)
        kind = rng.random()
        if kind < 0.2:
            out.append(list(base))
        elif kind < 0.9:
            out.append(base[:rng.randint(1, len(base))] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))])
        else:
            out.append([rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 30))])
    return out


def check_waves(mix: str, seed: int, *, bs: int, m: int, budget: int, n: int) -> tuple[int, int]:
    """Three waves: random shared prompts, then the same prompts again, then each extended by its answer
    and new tokens (the next chat turn). Returns (hit tokens, lower-bound tokens)."""
    rng = random.Random(seed)
    layers = MIXES[mix](bs, m)
    gran = bs * m if "m" in layers else bs
    engine, machine = make_engine(layers, caching=True, budget=budget)
    off, _ = make_engine(layers, caching=False, budget=budget)
    prompts = workload(rng, n)
    max_tokens = {f"a{i}": rng.randint(1, 9) for i in range(n)}
    waves = [{f"a{i}": p for i, p in enumerate(prompts)}]
    total_hit = total_lower = 0
    finished: list[tuple[list[int], list[int]]] = []          # (prompt, answer) of earlier waves
    for w in range(3):
        prompts_w = waves[w]
        mt = {rid: max_tokens[f"a{rid[1:]}"] for rid in prompts_w}
        work_on, work_off = engine._prompt_tokens, off._prompt_tokens
        outs = run_wave(engine, prompts_w, mt)
        assert outs == run_wave(off, prompts_w, mt)            # (the machine samples a hash of the sequence)
        assert engine._prompt_tokens - work_on <= off._prompt_tokens - work_off, "prefix caching added work"
        for pos, rid in enumerate(engine.order):
            if rid not in prompts_w:
                continue
            p = prompts_w[rid]
            cap = (len(p) - 1) // gran * gran
            lower = 0
            for other in engine.order[:pos]:                       # admitted earlier in this wave ...
                if other in prompts_w:
                    q = prompts_w[other]
                    shared = min(common(p, q), len(q) - 1, cap) // gran * gran
                    # ... and computed their shared prefix, which saves a step's worth of tokens
                    if engine.hits[other] < shared and shared >= budget * STOP_MIN_SAVING:
                        lower = max(lower, shared)
            for q, a in finished:                                  # finished in earlier waves
                seq = q + a
                for end in ((len(q) - 1) // gran * gran, (len(seq) - 1) // gran * gran):
                    if end <= min(common(p, seq), cap):
                        lower = max(lower, end)
            hit = engine.hits[rid]
            assert hit >= lower, f"{mix} wave {w}: {rid} hit {hit} < {lower} (prompt {len(p)} tokens)"
            assert hit <= cap
            total_hit += hit
            total_lower += lower
        engine.order.clear()
        finished += [(prompts_w[rid], outs[rid]) for rid in prompts_w]
        if w == 0:
            waves.append({f"b{i}": list(p) for i, p in enumerate(prompts)})
        elif w == 1:
            new = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(n)]
            waves.append({f"c{i}": prompts[i] + outs[f"b{i}"] + new[i] for i in range(n)})
    for e in (engine, off):
        c = e.coordinator
        c.check_invariants()
        assert c.num_requests == 0 and len(c.sharing) == 0 and (c.state is None or not c.state._wanted)
        assert not e.scheduler._owner and not e.scheduler._claims and not e.scheduler._stops
    return total_hit, total_lower


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seed", range(3))
def test_hits_land_where_the_brute_force_says(mix: str, seed: int) -> None:
    rng = random.Random(100 + seed)
    hit, lower = check_waves(mix, seed, bs=rng.choice([2, 4]), m=rng.choice([1, 2]), budget=rng.choice([7, 16, 64]),
                             n=rng.randint(4, 10))
    assert lower > 0 and hit >= lower


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=st.sampled_from(sorted(MIXES)), seed=st.integers(0, 10**6), bs=st.sampled_from([1, 2, 4]),
       m=st.sampled_from([1, 2]), budget=st.integers(1, 40), n=st.integers(1, 8))
def test_hits_land_where_the_brute_force_says_hypothesis(mix: str, seed: int, bs: int, m: int, budget: int,
                                                          n: int) -> None:
    check_waves(mix, seed, bs=bs, m=m, budget=budget, n=n)


@pytest.mark.parametrize("mix", ["mamba", "all"])
def test_tight_memory_degrades_hits_never_the_states(mix: str) -> None:
    """Few blocks, working slots and checkpoint slots: preemption, refused and evicted checkpoints; every
    read and state is still exact, everything finishes and is freed."""
    preempted = lost = 0
    for seed in range(6):
        rng = random.Random(seed)
        layers = MIXES[mix](2, 2)
        budget = rng.choice([5, 12])
        probe, _ = make_engine(layers, caching=True, budget=budget, max_len=64)
        one = probe.coordinator.blocks_to_admit(64) + probe.plan.reserved_step_blocks + 1    # one longest request
        engine, _ = make_engine(layers, caching=True, budget=budget, num_blocks=one + rng.randint(0, one // 2),
                                working=rng.randint(3, 5), checkpoints=rng.randint(1, 3), max_len=64)
        accepted = []
        for i, p in enumerate(workload(rng, 10)):
            with contextlib.suppress(RequestError):        # longer than the whole cache holds
                engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 30),
                                                              ignore_eos=True))
                accepted.append(f"r{i}")
        assert len(accepted) >= 5
        assert sorted(drain(engine)) == sorted(accepted)
        preempted += engine.scheduler.num_preemptions
        c = engine.coordinator
        lost += c.checkpoint_stats().evicted + c.checkpoint_stats().refused
        c.check_invariants()
        assert c.num_requests == 0 and c.num_free_slots == c.slots.num_working_slots
        assert c.num_free_blocks == c.pool.num_blocks - 1
    assert preempted > 0 and lost > 0, "the pools were meant to be small enough to preempt and lose checkpoints"

"""Oracle test of the coordinator: random interleavings of add / admit (prefix hit) / chunked prefill /
decode / batch steps / finish / preempt / abort / row swaps over mixed groups, block sizes 1-4, small
windows and chunks, and pools small enough that allocation fails.

The oracle tracks what a model runner would write: the token prefix each block and each Mamba slot
holds. After every operation it checks, independently of the implementation's bookkeeping:
  * every key a future query can see (per kind) sits in a live, non-null block holding exactly the
    request's tokens; fully skipped entries are null;
  * a block held by several entries is shared through the prefix cache (same group, same position,
    registered hash) and its ref count equals the number of entries holding it;
  * no request holds more blocks than ``max_blocks_per_request`` for its step;
  * a failed allocate changed nothing; a write never lands in a registered (shared) block;
  * prefix-hit lengths equal a brute-force search over every length;
  * Mamba working slots hold the state of exactly the computed prefix (hits and checkpoints included);
  * with no requests left, every non-null block and every working slot is free.

The same operations run twice: under a hypothesis RuleBasedStateMachine (shrinks failures) and as
seeded random sequences (long runs, so hits on every kind happen often).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.specs import AttentionSpec, KVCacheSpec
from hybridkv.utils import cdiv
from tests._kv_helpers import (
    apply_copies,
    brute_force_hit,
    chunked,
    fingerprint,
    full,
    mamba,
    sliding,
    small_plan,
    visible_start,
)

MAX_LEN = 40


class Draw(Protocol):
    def int(self, lo: int, hi: int) -> int: ...
    def choice(self, seq: Sequence[Any]) -> Any: ...


class HypDraw:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.data.draw(st.sampled_from(list(seq)))


class RandDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.rng.choice(list(seq))


def tokens(d: Draw, lo: int, hi: int) -> list[int]:
    return [d.int(0, 2) for _ in range(d.int(lo, hi))]


@dataclass
class Req:
    tokens: list[int]       # prompt + every token it will generate
    known: int              # tokens known so far (prompt + sampled)
    nc: int = 0             # computed tokens
    admitted: bool = False  # registered in the coordinator


class Oracle:
    """The coordinator under test plus a model of what the runner wrote; one method per operation."""

    def __init__(self, d: Draw) -> None:
        bs = d.int(1, 4)
        kinds = {d.choice(["full", "sliding", "sliding2", "chunked", "mamba"]) for _ in range(d.int(1, 4))}
        layers: dict[str, KVCacheSpec] = {}
        for kind in sorted(kinds):
            if kind == "full":
                spec: KVCacheSpec = full(bs)
            elif kind == "sliding":
                spec = sliding(d.int(1, 10), bs)
            elif kind == "sliding2":
                spec = sliding(d.int(1, 10), bs, heads=2)
            elif kind == "chunked":
                spec = chunked(bs * d.int(1, 3), bs)
            else:
                spec = mamba(bs * d.int(1, 2))
            for _ in range(d.int(1, 2)):
                layers[f"layer{len(layers)}"] = spec
        self.plan = small_plan(layers, num_blocks=d.int(2, 64), num_working_slots=d.int(1, 4),
                               num_checkpoint_slots=d.int(0, 4), max_model_len=MAX_LEN, num_host_slots=d.int(0, 3))
        self.c = KVCacheCoordinator(self.plan, enable_prefix_caching=d.int(0, 3) > 0,
                                    max_num_reqs=d.int(1, 5), hash_algorithm=d.choice(["builtin", "blake2b"]))
        self.bases = [tokens(d, 4, 28) for _ in range(d.int(1, 3))]
        self.attn = [g for g in self.plan.groups if isinstance(g.spec, AttentionSpec)]
        self.kinds = "+".join(sorted({g.spec.kind for g in self.plan.groups}))
        self.reqs: dict[str, Req] = {}
        self.content: dict[int, tuple] = {}     # block id -> (group id, token prefix it holds)
        self.states: dict[int, object] = {}     # Mamba slot -> token prefix of its state
        self.next_id = 0
        self.events: Counter[str] = Counter()

    # -- helpers ---------------------------------------------------------------------------------
    def _pick(self, d: Draw, admitted: bool) -> str | None:
        ids = sorted(r for r, q in self.reqs.items() if q.admitted == admitted)
        return d.choice(ids) if ids else None

    def _new(self, toks: list[int], d: Draw) -> None:
        toks = toks[:MAX_LEN] if len(toks) >= 2 else [0, 1]
        self.reqs[f"r{self.next_id}"] = Req(tokens=toks, known=d.int(1, len(toks)))
        self.next_id += 1

    def _forward(self, rid: str, k: int) -> None:
        """What the runner does after a successful allocate: copies, state check, KV + state writes."""
        q, c = self.reqs[rid], self.c
        for g in self.attn:
            bs = g.spec.block_size
            ids = c.block_ids(rid, g.group_id)
            held = int((ids != 0).sum())
            assert held <= g.spec.max_blocks_per_request(num_tokens=q.nc + k, step_tokens=k), \
                f"group {g.group_id} holds {held} blocks, over its bound"
            for col in range(q.nc // bs, cdiv(q.nc + k, bs)):
                b = int(ids[col])
                assert b != 0, "a token to compute has no block"
                assert c.pool.block_hash(b) is None, "write into a registered (shareable) block"
                self.content[b] = (g.group_id, tuple(q.tokens[:min(q.nc + k, (col + 1) * bs)]))
        if c.state:
            src, dst = c.take_state_copies()
            assert np.unique(dst).size == dst.size
            host = c.slots.num_slots
            # the runner copies to host memory first and from it last: no host slot may be both in one batch
            assert not set(src[src >= host].tolist()) & set(dst[dst >= host].tolist()), "host slot read and written"
            assert not ((src >= host) & (dst >= host)).any(), "a host -> host copy"
            if (dst >= host).any():
                self.events["host memory: checkpoint moved there"] += 1
            if (src >= host).any():
                self.events["host memory: a hit copied from there"] += 1
            apply_copies(self.states, src, dst)
            slot = c.mamba_slot(rid)
            assert slot != 0
            if q.nc == 0:
                self.states[slot] = ()
            else:
                assert self.states.get(slot) == tuple(q.tokens[:q.nc]), "Mamba state is not the prefix"
            self.states[slot] = tuple(q.tokens[:q.nc + k])

    def _release(self, rid: str) -> None:
        assert self.c.free(rid)
        q = self.reqs[rid]
        q.admitted, q.nc = False, 0

    def _step_size(self, d: Draw, q: Req) -> int:
        if q.nc == q.known and q.known < len(q.tokens):
            q.known += 1                     # the last forward sampled a token
        return d.int(1, q.known - q.nc) if q.known > q.nc else 0

    # -- operations ------------------------------------------------------------------------------
    def add(self, d: Draw) -> None:
        self._new(d.choice(self.bases) + tokens(d, 0, 12), d)

    def add_sibling(self, d: Draw) -> None:
        """A request sharing a long prefix with an existing one (so prefix hits happen)."""
        if self.reqs:
            other = self.reqs[d.choice(sorted(self.reqs))].tokens
            self._new(other[:d.int(1, len(other))] + tokens(d, 0, 8), d)

    def admit(self, d: Draw) -> None:
        rid = self._pick(d, admitted=False)
        if rid is None:
            return
        q = self.reqs[rid]
        prompt = q.tokens[:q.known]
        expected = brute_force_hit(self.c, prompt)
        hit = self.c.find_prefix_hit(rid, prompt)
        if not self.c.has_request(rid):
            assert hit == 0 and self.c.num_requests == self.c.max_num_reqs
            return
        assert hit == expected, f"prefix hit {hit} != brute force {expected}"
        assert hit == 0 or (hit % self.c.block_size == 0 and hit < len(prompt))
        q.admitted, q.nc = True, hit
        if hit:
            self.events[f"hit {self.kinds}"] += 1
        for g in self.attn:       # every hit block holds exactly this prompt's tokens
            ids = self.c.block_ids(rid, g.group_id)
            if hit and not ids.all():
                self.events["hit with skipped entries"] += 1
            for col in np.nonzero(ids)[0].tolist():
                end = (col + 1) * g.spec.block_size
                assert self.content[int(ids[col])] == (g.group_id, tuple(prompt[:end]))

    def step(self, d: Draw) -> None:
        rid = self._pick(d, admitted=True)
        if rid is None:
            return
        q = self.reqs[rid]
        k = self._step_size(d, q)
        if k == 0:
            self._release(rid)              # finished
            del self.reqs[rid]
            return
        before = fingerprint(self.c)
        ok = self.c.allocate(rid, num_computed_tokens=q.nc, num_new_tokens=k, token_ids=q.tokens[:q.known])
        if not ok:
            assert fingerprint(self.c) == before, "a failed allocate changed state"
            self.events["allocate failed"] += 1
            if d.int(0, 1):
                self._release(rid)          # the scheduler preempts it
            return
        self._forward(rid, k)
        q.nc += k
        self.c.commit(rid, num_computed_tokens=q.nc, token_ids=q.tokens[:q.known])

    def prefill(self, d: Draw) -> None:
        """Run one request's known tokens to the end in chunks (fills the cache quickly)."""
        rid = self._pick(d, admitted=True)
        if rid is None:
            return
        q = self.reqs[rid]
        chunk = d.int(1, 8)
        while q.nc < q.known:
            k = min(chunk, q.known - q.nc)
            if not self.c.allocate(rid, num_computed_tokens=q.nc, num_new_tokens=k,
                                   token_ids=q.tokens[:q.known]):
                return
            self._forward(rid, k)
            q.nc += k
            self.c.commit(rid, num_computed_tokens=q.nc, token_ids=q.tokens[:q.known])
            self.check()

    def batch_step(self, d: Draw) -> None:
        running = sorted(r for r, q in self.reqs.items() if q.admitted)
        if not running:
            return
        chosen = [r for r in running if d.int(0, 2)] or [running[0]]
        steps = {rid: self._step_size(d, self.reqs[rid]) for rid in chosen}
        chosen = [rid for rid in chosen if steps[rid] > 0]
        if not chosen:
            return
        rows = np.array([self.c.row_of(r) for r in chosen])
        nc = np.array([self.reqs[r].nc for r in chosen])
        k = np.array([steps[r] for r in chosen])
        before = fingerprint(self.c)
        if not self.c.allocate_batch(rows, nc, k):
            assert fingerprint(self.c) == before, "a failed allocate_batch changed state"
            self.events["allocate_batch failed"] += 1
            return
        for rid in chosen:
            self._forward(rid, steps[rid])
            self.reqs[rid].nc += steps[rid]
        self.c.commit_batch(rows, nc + k, [self.reqs[r].tokens[:self.reqs[r].known] for r in chosen])

    def preempt_or_abort(self, d: Draw) -> None:
        rid = self._pick(d, admitted=True)
        if rid is not None:
            self._release(rid)
            if d.int(0, 1):
                del self.reqs[rid]

    def swap(self, d: Draw) -> None:
        self.c.swap_rows(d.int(0, self.c.max_num_reqs - 1), d.int(0, self.c.max_num_reqs - 1))

    OPS = ("add", "add_sibling", "admit", "admit", "step", "step", "prefill", "batch_step",
           "preempt_or_abort", "swap")

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        c = self.c
        c.check_invariants()
        holders: dict[int, list[tuple[int, int, str]]] = {}
        for rid, q in self.reqs.items():
            if not q.admitted:
                continue
            for g in self.attn:
                bs = g.spec.block_size
                ids = c.block_ids(rid, g.group_id)
                assert ids.size == cdiv(q.nc, bs), "entries beyond the computed tokens after a step"
                start = visible_start(g.spec, q.nc) // bs
                assert (ids[:start] == 0).all(), "a fully skipped block is still held"
                for col in range(start, ids.size):
                    b = int(ids[col])
                    assert b != 0 and c.pool.ref_count[b] > 0, "a visible key has no live block"
                    want = (g.group_id, tuple(q.tokens[:min(q.nc, (col + 1) * bs)]))
                    assert self.content.get(b) == want, "a visible block holds other tokens"
                    holders.setdefault(b, []).append((g.group_id, col, rid))
                held = int((ids != 0).sum())
                assert held <= g.spec.max_blocks_per_request(num_tokens=max(q.nc, 1), step_tokens=1)
            if c.state and q.nc > 0 and c.mamba_slot(rid):
                assert self.states.get(c.mamba_slot(rid)) == tuple(q.tokens[:q.nc]), "stale Mamba state"
        for b, where in holders.items():
            assert int(c.pool.ref_count[b]) == len(where), "ref count != entries holding the block"
            if len(where) > 1:
                assert len({(g, col) for g, col, _ in where}) == 1, "one block in two places"
                assert c.pool.block_hash(b) is not None, "shared block without a registered hash"
        if c.num_requests == 0:
            if c.pool:
                assert c.num_free_blocks == c.pool.num_blocks - 1, "blocks leaked after all requests ended"
            if c.slots:
                assert c.num_free_slots == c.slots.num_working_slots, "working slots leaked"

    def finish_all(self) -> None:
        for rid, q in list(self.reqs.items()):
            if q.admitted:
                self._release(rid)
        self.check()
        assert self.c.num_requests == 0


class KVCacheMachine(RuleBasedStateMachine):
    """Hypothesis drives the oracle's operations (and shrinks any failure to a short sequence)."""

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.o = Oracle(HypDraw(data))

    @rule(data=st.data(), op=st.sampled_from(Oracle.OPS))
    def operate(self, data: st.DataObject, op: str) -> None:
        getattr(self.o, op)(HypDraw(data))
        for name in self.o.events:
            event(name)
        self.o.events.clear()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "o"):
            self.o.check()

    def teardown(self) -> None:
        if hasattr(self, "o"):
            self.o.finish_all()


def _oracle_settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


class TestKVCacheOracle(KVCacheMachine.TestCase):       # the quick tier's runs
    settings = _oracle_settings(60)


@pytest.mark.slow       # all 250 (under a derandomized profile the first 60 repeat the quick tier's)
class TestKVCacheOracleMoreRuns(KVCacheMachine.TestCase):
    settings = _oracle_settings(250)


@pytest.mark.parametrize("chunk", range(8))
def test_random_operation_sequences(chunk: int) -> None:
    """Long seeded runs: every op checked; asserts hits happen for every kind and allocation fails."""
    totals: Counter[str] = Counter()
    for seed in range(chunk * 60, chunk * 60 + 60):
        d = RandDraw(seed)
        o = Oracle(d)
        for _ in range(80):
            getattr(o, d.choice(Oracle.OPS))(d)
            o.check()
        o.finish_all()
        totals += o.events
    if chunk == 0:
        print(dict(totals))


def test_random_sequences_reach_every_case() -> None:
    """The random runs above are not vacuous: hits on every kind, skipped entries, failed allocations."""
    totals: Counter[str] = Counter()
    for seed in range(320):
        d = RandDraw(seed)
        o = Oracle(d)
        for _ in range(80):
            getattr(o, d.choice(Oracle.OPS))(d)
        totals += o.events
    hit_kinds = {k for name in totals if name.startswith("hit ") and name != "hit with skipped entries"
                 for k in name[4:].split("+")}
    assert hit_kinds == {"full", "sliding_window", "chunked_local", "mamba"}, totals
    for name in ("hit with skipped entries", "allocate failed", "allocate_batch failed",
                 "host memory: checkpoint moved there", "host memory: a hit copied from there"):
        assert totals[name] > 0, totals


# -- hand-made cases -------------------------------------------------------------------------------
def _coordinator(layers: dict, *, num_blocks: int = 64, ckpt: int = 4, max_len: int = 32,
                 **kw: Any) -> KVCacheCoordinator:
    plan = small_plan(layers, num_blocks=num_blocks, num_working_slots=4, num_checkpoint_slots=ckpt,
                      max_model_len=max_len)
    return KVCacheCoordinator(plan, max_num_reqs=8, **kw)


def _cache(c: KVCacheCoordinator, group_id: int, hashes: list, cols: Sequence[int]) -> None:
    """Make blocks at ``cols`` of a token chain cached (free, findable) in one group."""
    assert c.pool is not None
    if cols:
        got = c.pool.allocate(len(cols), [group_id])[0]
        c.pool.cache_blocks([group_id], [hashes[j] for j in cols], got[None, :])
        c.pool.free(got)


TOKENS = list(range(100, 124))          # 24 tokens; with bs 2: 11 hashable blocks before the last token


@pytest.mark.parametrize(("spec", "cached", "max_len", "want"), [
    (full(2), {0, 1, 2}, 20, 6), (full(2), {0, 2}, 20, 2), (full(2), set(), 20, 0),
    (full(2), {0, 1, 2, 3, 4}, 6, 6),
    (sliding(5, 2), {3, 4}, 12, 10),        # needs cdiv(4, 2) = 2 blocks before L
    (sliding(5, 2), {4}, 12, 0), (sliding(5, 2), {0}, 12, 2), (sliding(5, 2), {0, 1, 2}, 12, 6),
    (sliding(3, 2), {2}, 12, 6), (sliding(1, 2), set(), 12, 12),
    (sliding(5, 2), {3, 4, 8, 9}, 20, 20),  # right-most window wins
    (chunked(4, 2), set(), 10, 8),          # a chunk boundary needs nothing
    (chunked(4, 2), {4}, 10, 10), (chunked(4, 2), {0}, 3, 2), (chunked(4, 2), {1}, 3, 0),
    (chunked(8, 2), {8, 9}, 20, 20), (chunked(8, 2), {8}, 20, 18), (chunked(8, 2), {4, 5}, 20, 16),
])
def test_attention_hit_rules(spec: KVCacheSpec, cached: set[int], max_len: int, want: int) -> None:
    c = _coordinator({"l0": spec})
    hashes = c.hasher.chain(TOKENS, 11)
    _cache(c, 0, hashes, sorted(cached))
    assert c.managers[0].find_longest_cache_hit(hashes, max_len) == want
    assert brute_force_hit(c, TOKENS[:max_len + 1]) == want


@pytest.mark.parametrize(("mbs", "ckpts", "max_len", "want"), [
    (2, [4], 20, 4), (2, [4, 8], 20, 8), (2, [], 20, 0), (2, [8], 6, 0), (4, [8], 20, 8), (4, [12], 11, 0),
])
def test_mamba_hit_rule(mbs: int, ckpts: list[int], max_len: int, want: int) -> None:
    c = _coordinator({"a": full(2), "m": mamba(mbs)})
    hashes = c.hasher.chain(TOKENS, 11)
    assert c.slots is not None and c.state is not None
    for length in ckpts:
        c.slots.store_checkpoint(hashes[length // 2 - 1])
    assert c.state.find_longest_cache_hit(hashes, max_len) == want


def test_hybrid_hit_is_a_fixed_point() -> None:
    """full accepts 14, sliding 14, Mamba 10 -> sliding 6 -> Mamba 6: three rounds to agree on 6."""
    c = _coordinator({"f": full(2), "s": sliding(4, 2), "m": mamba(2)})
    toks = TOKENS[:16]
    hashes = c.hasher.chain(toks, 7)
    _cache(c, 0, hashes, range(7))
    _cache(c, 1, hashes, [1, 2, 5, 6])
    assert c.slots is not None
    for length in (6, 10):
        c.slots.store_checkpoint(hashes[length // 2 - 1])
    assert c.longest_common_hit(hashes, 14) == 6 == brute_force_hit(c, toks)
    assert c.find_prefix_hit("r", toks) == 6
    assert c.block_ids("r", 0).tolist()[:3] != [0, 0, 0] and c.block_ids("r", 1)[0] == 0   # window only
    assert c.allocate("r", num_computed_tokens=6, num_new_tokens=10, token_ids=toks)
    src, dst = c.take_state_copies()
    assert dst.tolist() == [c.mamba_slot("r")] and src.tolist() == [c.slots.lookup_checkpoint(hashes[2])]
    assert c.stats.hit_tokens == 6 and c.stats.query_tokens == 16 and c.stats.hit_requests == 1


def test_last_prompt_token_is_always_recomputed() -> None:
    c = _coordinator({"f": full(2)})
    assert c.allocate("a", num_computed_tokens=0, num_new_tokens=8, token_ids=TOKENS[:8])
    c.commit("a", num_computed_tokens=8)
    assert c.find_prefix_hit("b", TOKENS[:8]) == 6          # all 8 cached, but the last must run
    assert c.find_prefix_hit("c", TOKENS[:9]) == 8


def test_sliding_window_frees_as_it_decodes() -> None:
    c = _coordinator({"s": sliding(4, 2)}, num_blocks=8)
    for n in range(12):
        assert c.allocate("r", num_computed_tokens=n, num_new_tokens=1, token_ids=TOKENS)
        c.commit("r", num_computed_tokens=n + 1)
    ids = c.block_ids("r", 0)                                # 12 tokens: keys 9.. visible -> cols 4, 5
    assert ids.size == 6 and (ids[:4] == 0).all() and (ids[4:] != 0).all()
    assert c.num_free_blocks == 7 - 2


def test_state_copies_compose_sequentially() -> None:
    c = _coordinator({"m": mamba(2)})
    for src, dst in [(1, 4), (4, 2), (3, 1), (5, 5), (2, 2)]:
        c.state.queue_copy(src, dst)
    src, dst = c.take_state_copies()
    assert dict(zip(dst.tolist(), src.tolist(), strict=True)) == {4: 1, 2: 1, 1: 3}
    assert c.take_state_copies()[0].size == 0


@pytest.mark.parametrize("seed", range(30))
def test_state_copies_parallel_equals_pairwise(seed: int) -> None:
    """Random copy sequences: the composed copies applied as one gather + scatter == applied one by one
    as queued (pair by pair in the returned order would not be: sources name contents before the batch)."""
    rng = random.Random(seed)
    c = _coordinator({"m": mamba(2)})
    truth = {s: s for s in range(6)}
    for _ in range(rng.randint(1, 12)):
        src, dst = rng.randrange(6), rng.randrange(6)
        c.state.queue_copy(src, dst)
        truth[dst] = truth[src]
    src, dst = c.take_state_copies()
    assert np.unique(dst).size == dst.size
    parallel = {s: s for s in range(6)}
    apply_copies(parallel, src, dst)
    assert parallel == truth
    state = torch.arange(6.0)[:, None].repeat(1, 3)          # what the runner does, on tensors
    state[torch.from_numpy(dst)] = state[torch.from_numpy(src)]
    assert state[:, 0].long().tolist() == [truth[s] for s in range(6)]


def test_batch_api_equals_per_request_api() -> None:
    layers = {"f": full(4), "s": sliding(6, 4), "c": chunked(8, 4), "m": mamba(4)}
    a, b = (_coordinator(layers, max_len=64, num_blocks=200) for _ in range(2))   # no evictions
    prompts = {f"r{i}": [i % 3] * 5 + list(range(40 + i)) for i in range(4)}
    for rid, toks in prompts.items():
        for c in (a, b):
            hit = c.find_prefix_hit(rid, toks[:9 + int(rid[1:])])
            assert c.allocate(rid, num_computed_tokens=hit, num_new_tokens=9 + int(rid[1:]) - hit,
                              token_ids=toks)
            c.commit(rid, num_computed_tokens=9 + int(rid[1:]))
    rows = np.array([a.row_of(r) for r in prompts])
    nc = np.array([9 + i for i in range(4)])
    for _ in range(20):
        assert a.allocate_batch(rows, nc, np.ones(4, np.int64))
        for rid, n in zip(prompts, nc.tolist(), strict=True):
            assert b.allocate(rid, num_computed_tokens=n, num_new_tokens=1)
        nc = nc + 1
        a.commit_batch(rows, nc)
        for rid, n in zip(prompts, nc.tolist(), strict=True):
            b.commit(rid, num_computed_tokens=n)
        a.check_invariants()
        assert a.num_free_blocks == b.num_free_blocks and a.stats == b.stats
        for g in range(3):      # same entries held / null, same cached keys (block ids may differ)
            assert set(a.pool.cached_hashes(g)) == set(b.pool.cached_hashes(g))
            for rid in prompts:
                assert ((a.block_ids(rid, g) != 0) == (b.block_ids(rid, g) != 0)).all()
                assert a.mamba_slot(rid) == b.mamba_slot(rid)


def test_admission_reserves_the_step_once() -> None:
    c = _coordinator({"s": sliding(8, 4)}, num_blocks=40, max_len=64)
    reserve = c.plan.reserved_step_blocks
    assert reserve == sliding(8, 4).transient_blocks_per_step(c.plan.step_tokens) > 0
    steady = sliding(8, 4).steady_blocks_per_request(64)
    assert c.blocks_to_admit(64) == steady
    admitted = 0
    while c.can_admit(64):
        assert c.allocate(f"r{admitted}", num_computed_tokens=0, num_new_tokens=steady * 4,
                          token_ids=list(range(64)))
        admitted += 1
    assert admitted == (39 - reserve) // steady
    assert c.num_free_blocks - reserve < steady
    assert c.can_admit(64, num_cached_tokens=64)           # a full prefix hit needs no new blocks


def test_usage_and_free_counts() -> None:
    c = _coordinator({"f": full(2), "s": sliding(4, 2), "m": mamba(2)}, num_blocks=21)
    assert c.allocate("r", num_computed_tokens=0, num_new_tokens=6, token_ids=TOKENS)
    assert c.usage() == {0: 3 / 20, 1: 3 / 20, 2: 1 / 4}
    assert c.num_free_blocks == 14 and c.num_free_slots == 3
    c.commit("r", num_computed_tokens=6)
    assert c.usage()[1] == 2 / 20
    assert c.free("r") and not c.free("r")
    assert c.num_free_blocks == 20 and c.num_free_slots == 4 and c.usage() == {0: 0.0, 1: 0.0, 2: 0.0}


def test_errors() -> None:
    c = _coordinator({"f": full(2)}, max_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        c.allocate("a", num_computed_tokens=0, num_new_tokens=17)
    assert not c.has_request("a")
    assert c.allocate("a", num_computed_tokens=0, num_new_tokens=4)
    with pytest.raises(ValueError, match="token_ids"):
        c.commit("a", num_computed_tokens=4)            # prefix caching needs the tokens
    with pytest.raises(ValueError, match="already holds"):
        c.find_prefix_hit("a", TOKENS)
    with pytest.raises(ValueError, match="block_size"):
        _coordinator({"f": full(4), "m": mamba(6)})
    with pytest.raises(ValueError, match="beyond"):
        c.commit("a", num_computed_tokens=6, token_ids=TOKENS)


def test_rows_run_out_without_exceptions() -> None:
    plan = small_plan({"f": full(2)}, num_blocks=32, max_model_len=16)
    c = KVCacheCoordinator(plan, max_num_reqs=2)
    assert c.allocate("a", num_computed_tokens=0, num_new_tokens=2)
    assert c.find_prefix_hit("b", TOKENS[:5]) == 0 and c.has_request("b")
    assert c.find_prefix_hit("c", TOKENS[:5]) == 0 and not c.has_request("c")
    assert not c.allocate("c", num_computed_tokens=0, num_new_tokens=2) and not c.has_request("c")
    assert not c.can_admit(2)


@pytest.mark.parametrize(("layers", "kw", "want"), [
    ({"f": full(2)}, {}, 9),                               # attention only: every full block, decode too
    ({"f": full(2), "m": mamba(2)}, {"decode_checkpoint_interval": 64}, 3),   # up to the prompt checkpoint (6)
    ({"f": full(2), "m": mamba(2)}, {"decode_checkpoint_interval": 8}, 8),    # ... the decode checkpoint at 16
    ({"f": full(2), "m": mamba(4)}, {"decode_checkpoint_interval": 64}, 2),   # ... at Mamba's granularity (4)
    ({"f": full(2), "m": mamba(2)}, {"decode_checkpoint_interval": 2}, 9),    # a checkpoint every block
    ({"f": full(2), "m": mamba(2)}, {"ckpt": 0}, 0),        # no checkpoint slots: no hit is possible
])
def test_registers_only_blocks_a_hit_can_use(layers: dict, kw: dict, want: int) -> None:
    """A hybrid hit needs a Mamba checkpoint at its length, so blocks past the last one are not hashed (a
    decoding request keeps one checkpoint, moved every ``decode_checkpoint_interval`` tokens)."""
    c = _coordinator(layers, **kw)
    assert c.find_prefix_hit("a", TOKENS[:7]) == 0
    for start, end in ((0, 2), (2, 4), (4, 6), (6, 7)):     # prefill chunks that end at checkpoints
        assert c.allocate("a", num_computed_tokens=start, num_new_tokens=end - start, token_ids=TOKENS)
        c.commit("a", num_computed_tokens=end)
    for n in range(7, 18):                                 # decode 11 tokens: 18 computed, 9 full blocks
        assert c.allocate("a", num_computed_tokens=n, num_new_tokens=1)
        c.commit("a", num_computed_tokens=n + 1)
    assert c.pool is not None and len(c.pool.cached_hashes(0)) == want
    c.free("a")
    assert c.find_prefix_hit("b", TOKENS[:19]) == min(2 * want, 18)
    c.check_invariants()


class _RegistersEveryBlock(KVCacheCoordinator):
    """The coordinator before ``_cache_cap``: every full block registered, hittable or not."""

    def _set_prompt(self, row: int, num_prompt_tokens: int) -> None:
        super()._set_prompt(row, num_prompt_tokens)
        self._cache_cap[row] = np.iinfo(np.int64).max


@pytest.mark.parametrize("seed", range(6))
def test_unhittable_blocks_change_no_hit(seed: int) -> None:
    """Multi-turn requests (each prompt extends an earlier request's prompt and decoded tokens, so decode
    blocks are what a hit would reach for) over full + sliding + Mamba layers, with a pool large enough that
    nothing is evicted: registering only the blocks up to the last checkpoint finds exactly the hits that
    registering every block finds."""
    rng = random.Random(seed)
    mbs = rng.choice([2, 4])
    layers = {"f": full(2), "s": sliding(5, 2), "m": mamba(mbs)}
    plan = small_plan(layers, num_blocks=4096, num_working_slots=4, num_checkpoint_slots=64, max_model_len=200)
    capped, every = (cls(plan, max_num_reqs=8) for cls in (KVCacheCoordinator, _RegistersEveryBlock))
    history: list[list[int]] = [[]]
    for i in range(12):
        base = rng.choice(history)
        tokens = base[:rng.randint(0, len(base))] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
        sampled = [rng.randrange(1, 50) for _ in range(rng.randint(0, 14))]
        chunks = [rng.randint(1, 3) for _ in range(len(tokens))]          # the same schedule for both
        hits = []
        for c in (capped, every):
            hit = c.find_prefix_hit(str(i), tokens)
            hits.append(hit)
            seq = list(tokens)
            done = hit
            for step in chunks:                                 # prefill in checkpoint-aligned chunks
                if done == len(tokens):
                    break
                end = min(len(tokens), (done // mbs + step) * mbs)
                assert c.allocate(str(i), num_computed_tokens=done, num_new_tokens=end - done, token_ids=seq)
                c.commit(str(i), num_computed_tokens=end)
                done = end
            for tok in sampled:                                 # then decode
                seq.append(tok)
                assert c.allocate(str(i), num_computed_tokens=done, num_new_tokens=1, token_ids=seq)
                c.commit(str(i), num_computed_tokens=done + 1)
                done += 1
            c.free(str(i))
            c.check_invariants()
        assert hits[0] == hits[1], (i, hits)
        history.append(seq)
    assert capped.stats.hit_tokens == every.stats.hit_tokens > 0
    assert capped.pool is not None and every.pool is not None
    assert len(capped.pool.cached_hashes(0)) < len(every.pool.cached_hashes(0))


def test_prefix_caching_off_and_decode_checkpoints() -> None:
    layers = {"f": full(2), "m": mamba(2)}
    off = _coordinator(layers, enable_prefix_caching=False)
    assert off.allocate("a", num_computed_tokens=0, num_new_tokens=8, token_ids=TOKENS)
    off.commit("a", num_computed_tokens=8)
    assert off.find_prefix_hit("b", TOKENS[:12]) == 0 and off.take_state_copies()[0].size == 0
    on = _coordinator(layers, decode_checkpoint_interval=2)
    assert on.find_prefix_hit("a", TOKENS[:3]) == 0
    for n in range(3, 9):                                  # decode past the 3-token prompt
        assert on.allocate("a", num_computed_tokens=n - 1 if n > 3 else 0, num_new_tokens=1 if n > 3 else 3,
                           token_ids=TOKENS)
        on.commit("a", num_computed_tokens=n)
    assert on.slots is not None and on.slots.num_checkpoints == 1   # at 4, moved to 6, then 8: one slot
    assert on.find_prefix_hit("b", TOKENS[:12]) == 8

"""Block pool, state-slot pool and block hashing, on tiny hand-made cases."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridkv.kv_groups.block_pool import BlockPool, CheckpointKind, StateSlotPool
from hybridkv.kv_groups.hashing import BlockHasher


def ids(*v: int) -> np.ndarray:
    return np.array(v, np.int32)


# -- block pool ----------------------------------------------------------------------------------
def test_null_block_is_never_handed_out() -> None:
    p = BlockPool(6, 1)
    assert p.num_free_blocks == 5
    got = p.allocate(5, [0])
    assert got.tolist() == [[1, 2, 3, 4, 5]] and p.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        p.allocate(1, [0])
    p.free(ids(0, 3, 0))                 # null entries are ignored
    assert p.num_free_blocks == 1 and p.ref_count[0] == 0
    p.check_invariants()


def test_freeing_blocks_without_keys_leaves_the_lru_as_it_was() -> None:
    """Without prefix caching no freed block has a key: they go back to the plain stack, and the cached blocks' queue
    gets no entry (an empty one a free call would never be compacted away: a long-running server's memory grew with
    every request and every sliding-window step that freed blocks)."""
    p = BlockPool(100, 2)
    for _ in range(1000):
        got = p.allocate(3, [0, 1])
        p.free(got[:, ::-1].T.reshape(-1))
    assert len(p._lru) == 0 and p._lru_entries == p._num_lru == 0 and p.num_free_blocks == 99
    p.check_invariants()


def test_allocate_for_several_groups() -> None:
    p = BlockPool(8, 3)
    got = p.allocate(2, [0, 2])
    assert got.shape == (2, 2) and sorted(got.ravel().tolist()) == [1, 2, 3, 4]
    assert p.live_blocks_per_group().tolist() == [2, 0, 2]
    p.free(got[1])
    assert p.live_blocks_per_group().tolist() == [2, 0, 0]
    p.check_invariants()


def test_ref_counts_and_cached_blocks_stay_findable_until_reused() -> None:
    p = BlockPool(4, 1)
    a, b, c = p.allocate(3, [0])[0].tolist()
    p.cache_blocks([0], ["ha", "hb"], np.array([[a, b]]))
    p.touch(0, [a])                                          # a second request shares a
    assert p.ref_count[a] == 2
    p.free(ids(c, b, a))                                     # first owner ends (last block first)
    assert p.ref_count[a] == 1 and p.num_free_blocks == 2
    assert p.lookup(0, "hb") == b and p.num_cached_free_blocks == 1
    p.touch(0, [b])                                          # revived from the free queue
    assert p.ref_count[b] == 1 and p.num_free_blocks == 1
    p.free(ids(b))
    p.free(ids(a))
    p.check_invariants()
    # Plain c first, then least-recently-freed cached b, evicting its hash; a stays findable.
    assert p.allocate(1, [0]).item() == c and p.lookup(0, "hb") == b
    assert p.allocate(1, [0]).item() == b and p.lookup(0, "hb") == 0 and p.lookup(0, "ha") == a
    assert p.allocate(1, [0]).item() == a and p.lookup(0, "ha") == 0
    p.check_invariants()


@pytest.mark.parametrize("slack", [0, 1024])
def test_lru_evicts_least_recently_freed_against_an_ordered_dict(slack: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random allocations, registrations, frees and revivals: the LRU (a queue of stamped arrays, stale entries
    skipped, compacted once stale ones dominate: ``slack`` 0 compacts almost every free) frees, revives and
    evicts exactly as an OrderedDict of the cached free blocks would, oldest first."""
    monkeypatch.setattr(BlockPool, "_COMPACT_SLACK", slack)
    rng = np.random.default_rng(slack)
    p = BlockPool(41, 2)
    ref: dict[int, None] = {}                         # insertion-ordered: the cached free blocks, oldest first
    held: list[tuple[int, int]] = []                  # (group, block) references
    hashes = iter(range(10**6))
    for _ in range(1500):
        op = rng.integers(4)
        if op == 0 and p.num_free_blocks:             # allocate; past the plain stack, evictions oldest first
            k, g = int(rng.integers(1, p.num_free_blocks + 1)), int(rng.integers(2))
            plain = p.num_free_blocks - len(ref)
            evicted = list(ref)[:max(0, k - plain)]
            got = p.allocate(k, [g])[0].tolist()
            assert set(evicted) <= set(got)
            for b in evicted:
                del ref[b]
            held += [(g, b) for b in got]
        elif op == 1 and held:                        # register some held blocks of one group
            g = held[int(rng.integers(len(held)))][0]
            blocks = sorted({b for gg, b in held if gg == g and p.block_hash(b) is None})[:3]
            if blocks:
                p.cache_blocks([g], [("k", next(hashes)) for _ in blocks], np.array([blocks], np.int32))
        elif op == 2 and held:                        # free a few references, in order
            picks = sorted(set(rng.integers(len(held), size=int(rng.integers(1, 4))).tolist()), reverse=True)
            gone = [held.pop(i)[1] for i in picks]
            p.free(np.array(gone, np.int32))
            for b in dict.fromkeys(gone):
                if p.ref_count[b] == 0 and p.block_hash(b) is not None:
                    ref[b] = None
        elif op == 3 and ref:                         # a prefix hit revives a cached free block
            b = list(ref)[int(rng.integers(len(ref)))]
            g = int(p._owner[b])
            p.touch(g, [b])
            del ref[b]
            held.append((g, b))
        assert p.lru_order() == list(ref)
        p.check_invariants()


def test_hash_maps_are_per_group_and_first_wins() -> None:
    p = BlockPool(8, 2)
    (a, b), (c, d) = p.allocate(2, [0, 1]).tolist()
    p.cache_blocks([0, 1], ["h"], np.array([[a], [c]]))
    assert p.lookup(0, "h") == a and p.lookup(1, "h") == c
    p.cache_blocks([0], ["h", "h2"], np.array([[b, 0]]))     # duplicate content: b stays plain
    assert p.lookup(0, "h") == a and p.block_hash(b) is None and not p.is_cached(0, "h2")
    p.cache_blocks([0], ["other"], np.array([[a]]))          # a keeps its first key
    assert p.block_hash(a) == "h" and not p.is_cached(0, "other")
    p.free(ids(a, b, c, d))
    assert p.num_cached_free_blocks == 2
    p.check_invariants()


def test_num_freed_by_counts_shared_blocks_once() -> None:
    p = BlockPool(5, 1)
    a, b = p.allocate(2, [0])[0].tolist()
    p.cache_blocks([0], ["x"], np.array([[a]]))
    p.touch(0, [a])
    assert p.num_freed_by(ids(a, b)) == 1              # a still held once more
    assert p.num_freed_by(ids(a, a, b)) == 2           # both holders of a let go
    before = p.ref_count.copy()
    p.num_freed_by(ids(a, a))
    assert (p.ref_count == before).all()
    p.free(ids(a, a, b))
    assert p.num_free_blocks == 4
    p.check_invariants()


def test_free_of_a_free_block_is_an_error() -> None:
    p = BlockPool(4, 1)
    a, b = p.allocate(2, [0])[0].tolist()
    p.cache_blocks([0], ["k"], np.array([[a]]))
    p.touch(0, [a])
    p.free(ids(a, a, b))
    with pytest.raises(RuntimeError, match="free of a free block"):
        p.free(ids(a, b))


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, 1)
    with pytest.raises(ValueError, match="num_slots"):
        StateSlotPool(3, 2)


# -- state-slot pool -----------------------------------------------------------------------------
def test_working_slots_and_checkpoint_partition() -> None:
    s = StateSlotPool(6, 2)                     # null 0, working 1-3, checkpoints 4-5
    assert s.num_working_slots == 3 and s.num_free_slots == 3
    got = s.allocate(3)
    assert got.tolist() == [1, 2, 3]
    with pytest.raises(RuntimeError):
        s.allocate(1)
    s.free(np.array([2, 0]))
    assert s.num_free_slots == 1
    with pytest.raises(RuntimeError):
        s.free(np.array([2]))
    s.check_invariants()


def test_checkpoints_lru_with_pins() -> None:
    s = StateSlotPool(4, 2)                     # working 1, checkpoints 2-3
    a, new_a = s.store_checkpoint("a")
    b, new_b = s.store_checkpoint("b")
    assert {a, b} == {2, 3} and new_a and new_b
    assert s.store_checkpoint("a") == (a, False)           # already stored; now most recent
    c, _ = s.store_checkpoint("c")                          # evicts b (least recently used)
    assert c == b and s.lookup_checkpoint("b") == 0 and s.lookup_checkpoint("c") == c
    s.pin(a)
    s.pin(c)
    assert s.store_checkpoint("d") == (0, False)            # every checkpoint is pinned
    s.unpin(c)
    d, new_d = s.store_checkpoint("d")
    assert d == c and new_d and s.lookup_checkpoint("a") == a
    s.check_invariants()


def test_host_tier_keeps_what_the_device_slots_evict() -> None:
    s = StateSlotPool(4, 2, num_host_slots=2)   # working 1, checkpoints 2-3, host checkpoints 4-5
    a, _ = s.store_checkpoint("a")
    b, _ = s.store_checkpoint("b")
    assert s.take_demotions() == []
    c, new_c = s.store_checkpoint("c")          # a (least recently used) moves to host slot 4
    assert c == a and new_c and s.take_demotions() == [(a, 4)]
    assert s.lookup_checkpoint("a") == 4 and s.is_host(4) and not s.is_host(c)
    assert s.store_checkpoint("a") == (4, False)     # stored (in host memory): nothing to copy
    s.pin(4)                                         # a hit on it waits for its copy
    d, _ = s.store_checkpoint("d")                   # b moves to host slot 5
    assert d == b and s.take_demotions() == [(b, 5)]
    s.store_checkpoint("e")                          # c: the host tier is full, a pinned: b is lost
    assert s.take_demotions() == [(c, 5)] and s.lookup_checkpoint("b") == 0
    assert s.num_demoted == 3 and s.num_evicted == 1 and s.num_host_checkpoints == 2
    assert set(s.checkpoints()) == {"a", "c", "d", "e"}
    s.unpin(4)
    s.want(5)                                        # a waiting request means to start from c
    s.store_checkpoint("f")                          # d moves to host memory: a (no longer pinned) makes room
    assert s.take_demotions() == [(d, 4)]
    assert s.lookup_checkpoint("a") == 0 and s.lookup_checkpoint("c") == 5 and s.num_evicted == 2
    s.check_invariants()


def test_host_tier_evicts_by_last_use_after_a_hit_there() -> None:
    s = StateSlotPool(4, 2, num_host_slots=2)   # working 1, checkpoints 2-3, host 4-5
    for key in "abc":                           # a moves to host memory
        s.store_checkpoint(key)
    a = s.lookup_checkpoint("a")
    s.pin(a)                                    # a request starts from a: now its most recent use
    s.unpin(a)
    s.store_checkpoint("d")                     # b (not used since it was stored) moves to host, behind a
    s.store_checkpoint("e")                     # c moves to host: b, the least recently used there, makes room
    assert s.lookup_checkpoint("a") == a and s.lookup_checkpoint("b") == 0 and s.is_host(s.lookup_checkpoint("c"))
    s.check_invariants()


def test_a_growing_answer_moves_to_host_over_settled_ones() -> None:
    s = StateSlotPool(6, 4, num_host_slots=2)   # working 1, checkpoints 2-5, host 6-7
    s.store_checkpoint("a0", K.ANSWER)
    s.store_checkpoint("a1", K.ANSWER)
    s.store_checkpoint("g0", K.ANSWER, growing=True)
    s.store_checkpoint("g1", K.ANSWER, growing=True)
    s.store_checkpoint("p0", K.PROMPT)
    s.store_checkpoint("p1", K.PROMPT)          # the settled answers a0, a1 move to host memory
    s.take_demotions()
    s.store_checkpoint("p2", K.PROMPT)          # g0 leaves the device (a lower kind): into host, over a0
    assert s.is_host(s.lookup_checkpoint("g0")) and s.lookup_checkpoint("a0") == 0 and s.num_evicted == 1
    s.check_invariants()


def test_host_moves_past_the_budget_are_lost_not_waited_for() -> None:
    s = StateSlotPool(4, 2, num_host_slots=4)
    s.store_checkpoint("a")
    s.store_checkpoint("b")
    s.host_move_budget = 1                      # one copy out free (the runner's landed staging rows)
    s.store_checkpoint("c")                     # a moves to host memory
    s.store_checkpoint("d")                     # b is lost: the copies out are all in flight
    assert len(s.take_demotions()) == 1 and s.lookup_checkpoint("a") != 0 and s.lookup_checkpoint("b") == 0
    assert s.num_demoted == 1 and s.num_host_busy == 1 and s.num_evicted == 1 and s.host_move_budget == 0
    s.check_invariants()


def test_host_tier_needs_device_checkpoints() -> None:
    with pytest.raises(ValueError, match="host"):
        StateSlotPool(4, 0, num_host_slots=2)
    s = StateSlotPool(4, 2)                          # no host tier: the evicted checkpoint is lost
    s.store_checkpoint("a")
    s.store_checkpoint("b")
    s.store_checkpoint("c")
    assert s.take_demotions() == [] and s.num_evicted == 1 and s.lookup_checkpoint("a") == 0


K = CheckpointKind


@pytest.mark.parametrize(("stored", "new", "evicted"), [
    ([("b", K.BOUNDARY), ("p", K.PROMPT)], ("n", K.PROMPT), "b"),       # the lowest kind goes first ...
    ([("p", K.PROMPT), ("b", K.BOUNDARY)], ("n", K.PROMPT), "b"),       # ... whatever its age
    ([("p", K.PROMPT), ("q", K.PROMPT)], ("n", K.PROMPT), "p"),         # within a kind, least recently used
    ([("p", K.PROMPT), ("s", K.SHARED)], ("n", K.ANSWER), None),        # never a higher kind: refused
    ([("a", K.ANSWER), ("p", K.PROMPT)], ("n", K.SHARED), "a"),
    ([("s", K.SHARED), ("t", K.SHARED)], ("n", K.SHARED), "s"),
])
def test_checkpoint_eviction_by_kind_then_recency(stored, new, evicted) -> None:
    s = StateSlotPool(4, 2)
    for key, kind in stored:
        s.store_checkpoint(key, kind)
    slot, is_new = s.store_checkpoint(*new)
    if evicted is None:
        assert (slot, is_new) == (0, False) and s.num_refused == 1
        assert {k for k, _ in stored} == set(s.checkpoints())
    else:
        assert is_new and s.lookup_checkpoint(evicted) == 0 and s.lookup_checkpoint(new[0]) == slot
        assert s.num_evicted == 1
    s.check_invariants()


def test_a_hit_refreshes_and_a_second_store_raises_the_kind() -> None:
    s = StateSlotPool(4, 2)
    p, _ = s.store_checkpoint("p", K.PROMPT)
    s.store_checkpoint("q", K.PROMPT)
    s.pin(p)                                       # a hit: most recent now
    s.unpin(p)
    s.store_checkpoint("r", K.PROMPT)              # evicts q, not p
    assert s.lookup_checkpoint("p") == p and s.lookup_checkpoint("q") == 0
    assert s.store_checkpoint("p", K.SHARED) == (p, False) and s.kind_of(p) is K.SHARED
    assert s.store_checkpoint("p", K.BOUNDARY) == (p, False) and s.kind_of(p) is K.SHARED
    s.check_invariants()


def test_wanted_checkpoints_stay() -> None:
    s = StateSlotPool(4, 2)
    a, _ = s.store_checkpoint("a", K.BOUNDARY)
    s.store_checkpoint("b", K.BOUNDARY)
    s.want(a)                                      # a waiting request means to start from it
    s.store_checkpoint("c", K.SHARED)
    assert s.lookup_checkpoint("a") == a and s.lookup_checkpoint("b") == 0
    s.want(s.lookup_checkpoint("c"))
    assert s.store_checkpoint("d", K.SHARED) == (0, False) and not s.has_room(K.SHARED)
    s.unwant(a)
    assert s.has_room(K.SHARED) and s.store_checkpoint("d", K.SHARED)[0] == a
    s.check_invariants()


def test_answer_checkpoints_replace_their_own_and_spare_other_decoding_requests() -> None:
    s = StateSlotPool(5, 3)                        # checkpoint slots 2-4
    x, _ = s.store_checkpoint("x1", K.ANSWER, growing=True)
    y, _ = s.store_checkpoint("y1", K.ANSWER, growing=True)
    z, _ = s.store_checkpoint("z1", K.ANSWER, growing=True)
    assert s.store_checkpoint("x2", K.ANSWER, replace=x, growing=True) == (x, True)   # moved on, same slot
    assert s.lookup_checkpoint("x1") == 0
    assert not s.has_room(K.ANSWER)                # the others are still growing: no churn between them
    assert s.store_checkpoint("w", K.ANSWER, growing=True) == (0, False)
    s.settle(y)                                    # y's request finished: its answer may go now
    assert s.store_checkpoint("w", K.ANSWER, growing=True) == (y, True)
    assert s.store_checkpoint("p", K.PROMPT)[0] in (x, z)      # a higher kind may take a growing one
    s.check_invariants()


@pytest.mark.parametrize("use", ["hit", "same state", "wanted"])
def test_an_answer_checkpoint_someone_else_uses_is_not_replaced(use: str) -> None:
    s = StateSlotPool(5, 3)
    x, _ = s.store_checkpoint("x1", K.ANSWER, growing=True)
    if use == "hit":
        s.pin(x)
        s.unpin(x)
    elif use == "same state":
        assert s.store_checkpoint("x1", K.ANSWER) == (x, False)   # another request reached the same state
    else:
        s.want(x)
    slot, is_new = s.store_checkpoint("x2", K.ANSWER, replace=x, growing=True)
    assert is_new and slot != x and s.lookup_checkpoint("x1") == x
    s.check_invariants()


def test_an_answer_checkpoint_a_prompt_ends_at_stops_growing() -> None:
    """A decoding request's answer checkpoint that another request's prompt reaches becomes a prompt checkpoint (the
    higher kind protects it) and gives up the growing answer's exemption: answer stores may not count it among the
    growing ones, its request's later settle changes nothing, and the kind's lists stay consistent (the oracle in
    tests/test_kv_manager_oracle.py found this state)."""
    s = StateSlotPool(5, 3)
    x, _ = s.store_checkpoint("x1", K.ANSWER, growing=True)
    assert s.store_checkpoint("x1", K.PROMPT) == (x, False)
    assert s.kind_of(x) == K.PROMPT
    s.check_invariants()
    y, _ = s.store_checkpoint("y1", K.ANSWER, growing=True)
    assert s.store_checkpoint("y2", K.ANSWER, growing=True)[1]      # one free slot left: taken
    assert s.store_checkpoint("w", K.ANSWER, growing=True) == (0, False)  # both answers grow; the prompt outranks
    s.settle(x)
    s.check_invariants()


# -- hashing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["blake2b", "builtin"])
def test_chain_is_a_prefix_function(algorithm: str) -> None:
    h = BlockHasher(block_size=4, algorithm=algorithm)  # type: ignore[arg-type]
    toks = [5, 1, 2, 3, 9, 9, 9, 9, 0, 1, 2, 3, 7]
    chain = h.chain(toks)
    assert len(chain) == 3 and len(set(chain)) == 3
    assert h.chain(toks[:8]) == chain[:2]
    assert h.chain(np.array(toks, np.int32)) == chain == h.chain(np.array(toks, np.int64))
    other = h.chain([6] + toks[1:])                         # a different first block changes every key
    assert all(x != y for x, y in zip(chain, other, strict=True))
    assert h.chain([0, 1, 2, 3]) != h.chain([5, 1, 2, 3, 0, 1, 2, 3])[1:]   # same block, other parent
    salted = BlockHasher(block_size=4, algorithm=algorithm, salt=b"tenant-2")  # type: ignore[arg-type]
    assert salted.chain(toks)[0] != chain[0]
    grown: list = []
    h.extend(grown, toks, 2)
    h.extend(grown, toks, 3)
    assert grown == chain
    with pytest.raises(ValueError, match="cannot hash"):
        h.extend(grown, toks, 4)


def test_blake2b_keys_are_stable_across_runs() -> None:
    key = BlockHasher(block_size=2).chain([1, 2])[0]
    assert isinstance(key, bytes) and len(key) == 16
    assert key.hex() == BlockHasher(block_size=2).chain(np.array([1, 2]))[0].hex()
    assert key.hex() == "d32faeaeedf99f503fa1905a1fbe65f1"


def test_builtin_tuple_hash_ignores_the_process_hash_seed() -> None:
    code = "print(hash((123456789, 1, 2, 3)))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1


def test_bad_hasher() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        BlockHasher(block_size=4, algorithm="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size=0)


def test_cold_checkpoints_go_first_whatever_their_kind() -> None:
    """A checkpoint nobody stored or hit since the storing request arrived is cold: an answer may take a
    cold prompt's slot (old prompts cannot starve new answers), but not a warm one's."""
    s = StateSlotPool(4, 2)
    old, _ = s.store_checkpoint("old prompt", K.SHARED)
    arrived = s.clock                              # a request arrives now
    warm, _ = s.store_checkpoint("its prompt", K.PROMPT)
    assert s.store_checkpoint("its answer", K.ANSWER, since=arrived, growing=True) == (old, True)
    assert s.store_checkpoint("next answer", K.ANSWER, since=arrived) == (0, False)    # a warm prompt, a growing answer
    assert s.store_checkpoint("a later answer", K.ANSWER, since=s.clock) == (warm, True)      # cold by now
    s.check_invariants()

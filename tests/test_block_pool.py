"""Block pool, state-slot pool and block hashing, on tiny hand-made cases."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridkv.kv_groups.block_pool import BlockPool, StateSlotPool
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

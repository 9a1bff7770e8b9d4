"""SharedPrefixIndex: the stops of a request (ends of the prefixes it shares with other unfinished
requests), table-driven and against a brute force over the token sequences themselves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kv_groups.hashing import BlockHasher
from hybridkv.kv_groups.sharing import SharedPrefixIndex

HASHER = BlockHasher(block_size=2, algorithm="builtin")


def index(prompts: dict[str, list[int]]) -> SharedPrefixIndex:
    idx = SharedPrefixIndex()
    for rid, p in prompts.items():
        idx.add(rid, HASHER.chain(p, (len(p) - 1) // 2))
    return idx


def brute_stops(prompts: dict[str, list[int]], rid: str, step: int) -> list[tuple[int, int]]:
    """Aligned block counts j (in ``step`` multiples, within the request's chain) whose prefix >= 2 chains
    hold and the next aligned segment fewer, by comparing tokens."""
    bs = HASHER.block_size
    chains = {r: (len(p) - 1) // bs for r, p in prompts.items()}
    me = prompts[rid]

    def holders(j: int) -> int:       # chains with at least j blocks equal to mine
        return sum(1 for r, p in prompts.items() if chains[r] >= j and p[:j * bs] == me[:j * bs])

    out = []
    n = chains[rid] // step * step
    for j in range(step, n + 1, step):
        here = holders(j)
        after = holders(j + step) if j + step <= chains[rid] else 0
        if here >= 2 and here > after:
            out.append((j, here))
    return out


@pytest.mark.parametrize(("prompts", "rid", "step", "want"), [
    ({"a": [1] * 9, "b": [1] * 9}, "a", 1, [(4, 2)]),                           # identical: the chain end
    ({"a": [1, 2, 3, 4, 5, 6, 7], "b": [1, 2, 3, 4, 9, 9, 9]}, "a", 1, [(2, 2)]),
    ({"a": [1, 2, 3, 4, 5, 6, 7], "b": [1, 2, 3, 4, 9, 9, 9]}, "a", 2, [(2, 2)]),
    ({"a": list(range(9)), "b": list(range(6)) + [0] * 3}, "a", 2, [(2, 2)]),   # 3 shared: down to a boundary
    ({"a": list(range(9)), "b": list(range(3)) + [0] * 6}, "a", 2, []),         # 1 shared: no boundary
    ({"a": list(range(9)), "b": list(range(9)), "c": list(range(5)) + [0] * 4}, "a", 1, [(2, 3), (4, 2)]),
    ({"a": list(range(9)), "b": [7] + list(range(8))}, "a", 1, []),             # nothing shared
    ({"a": [5]}, "a", 1, []),                                                     # no full block before the last token
])
def test_stops(prompts: dict[str, list[int]], rid: str, step: int, want: list[tuple[int, int]]) -> None:
    idx = index(prompts)
    chain = idx.chain(rid)
    assert chain is not None
    assert idx.stops(chain, step) == want == brute_stops(prompts, rid, step)
    for j in range(len(chain) + 1):
        assert idx.is_stop(chain, j, step) == (j in [b for b, _ in want])


def test_remove_and_generation() -> None:
    idx = index({"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 6]})
    chain = idx.chain("a")
    gen = idx.generation(chain)
    assert idx.stops(chain) == [(2, 2)]
    idx.add("c", HASHER.chain([9, 9, 9], 1))
    assert idx.generation(chain) == gen                 # another first block: a's stops unchanged
    idx.remove("b")
    assert idx.generation(chain) != gen and idx.stops(chain) == [] and len(idx) == 2
    idx.remove("a")
    idx.remove("c")
    assert len(idx) == 0 and not idx._count
    # nothing is kept of chains that left (a server sees ever new first blocks): a first block seen again starts over,
    # and stops cached at a generation of before never match it (a chain in the index has generation >= 1)
    assert not idx._generation and idx.generation(chain) == 0
    idx.add("a2", chain)
    assert idx.generation(chain) == 1 and idx.stops(chain) == []
    with pytest.raises(ValueError, match="already"):
        idx.add("x", [])
        idx.add("x", [])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), step=st.sampled_from([1, 2, 3]))
def test_stops_equal_the_brute_force(data: st.DataObject, step: int) -> None:
    base = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=16))
    prompts = {}
    for i in range(data.draw(st.integers(1, 6))):
        cut = data.draw(st.integers(0, len(base)))
        prompts[f"r{i}"] = base[:cut] + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
    idx = index(prompts)
    for rid in prompts:
        chain = idx.chain(rid)
        assert idx.stops(chain, step) == brute_stops(prompts, rid, step)

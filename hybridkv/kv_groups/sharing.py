"""Which block-aligned prefixes several unfinished requests have in common.

A chained block hash stands for the whole prefix up to its block (``hashing.py``), so counting, over the
prompt chains of every unfinished request, how many chains contain each key gives, for any request, how
many others share each of its prefixes: along one chain the counts never grow. A request's *stops* are
the ends of its shared segments: lengths L (multiples of the checkpoint granularity) where at least two
requests share the prefix and fewer share the next segment. A prefill chunk that ends at a stop leaves a
state there that every other sharer can start from (a Mamba checkpoint needs exactly that; attention
blocks are registered at any block boundary anyway).

Keys: request ids. Chains are the prompt's ``(len - 1) // block_size`` keys (a hit always leaves the last
prompt token to compute). Cost: one ``Counter.update`` per arrival, one pass over the chain per removal
and per ``stops`` call; ``generation(first_key)`` lets callers cache a request's stops until a chain with
the same first block arrives or leaves (requests that share nothing are never recomputed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from hybridkv.kv_groups.hashing import BlockHash


class SharedPrefixIndex:
    """Counts of prompt-chain keys over the unfinished requests."""

    def __init__(self) -> None:
        self._count: Counter[BlockHash] = Counter()
        self._chains: dict[str, list[BlockHash]] = {}
        self._generation: Counter[BlockHash] = Counter()    # first key -> changes of chains starting with it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._chains

    def __len__(self) -> int:
        return len(self._chains)

    def chain(self, request_id: str) -> list[BlockHash] | None:
        """The prompt chain registered for ``request_id`` (do not modify it)."""
        return self._chains.get(request_id)

    def add(self, request_id: str, chain: list[BlockHash]) -> None:
        if request_id in self._chains:
            raise ValueError(f"request {request_id!r} is already in the shared-prefix index")
        self._chains[request_id] = chain
        if chain:
            self._count.update(chain)
            self._generation[chain[0]] += 1

    def remove(self, request_id: str) -> None:
        chain = self._chains.pop(request_id, None)
        if not chain:
            return
        count = self._count
        for key in chain:
            n = count[key] - 1
            if n:
                count[key] = n
            else:
                del count[key]
        # A chained key is the whole prefix, so only chains that start with it hold a first key: once none is left,
        # no request's cached stops read its generation, and it goes (kept, every distinct first block a server
        # ever saw would stay in memory).
        if chain[0] in count:
            self._generation[chain[0]] += 1
        else:
            del self._generation[chain[0]]

    def count(self, key: BlockHash) -> int:
        """Unfinished requests whose prompt chain contains ``key``."""
        return self._count.get(key, 0)

    def generation(self, chain: Sequence[BlockHash]) -> int:
        """Changes so far to the chains that start like ``chain``: its stops are unchanged while this is."""
        return self._generation.get(chain[0], 0) if chain else 0

    def stops(self, chain: Sequence[BlockHash], step_blocks: int = 1) -> list[tuple[int, int]]:
        """(blocks, sharers) at the ends of ``chain``'s shared segments, ascending, blocks a multiple of
        ``step_blocks``: aligned ``j`` where the first ``j`` blocks are shared by ``sharers`` >= 2 chains and
        the next ``step_blocks`` by fewer or run past the chain's end (this request leaves there). A drop
        inside an aligned segment stops at the segment's start."""
        n = len(chain) // step_blocks * step_blocks
        get = self._count.get
        if n == 0 or get(chain[step_blocks - 1], 0) < 2:      # counts never grow along a chain
            return []
        counts = np.fromiter((get(chain[j], 0) for j in range(step_blocks - 1, n, step_blocks)), np.int64,
                             n // step_blocks)                  # count at each aligned end
        nxt = np.zeros_like(counts)      # the count one aligned segment later; none after the last one
        nxt[:-1] = counts[1:]
        at = np.flatnonzero((counts >= 2) & (counts > nxt))
        return list(zip(((at + 1) * step_blocks).tolist(), counts[at].tolist(), strict=True))

    def is_stop(self, chain: Sequence[BlockHash], blocks: int, step_blocks: int = 1) -> bool:
        """Whether ``blocks`` (a multiple of ``step_blocks``) is one of ``chain``'s ``stops``."""
        if blocks <= 0 or blocks > len(chain) or blocks % step_blocks:
            return False
        here = self._count.get(chain[blocks - 1], 0)
        after = blocks + step_blocks - 1
        return here >= 2 and (after >= len(chain) or here > self._count.get(chain[after], 0))

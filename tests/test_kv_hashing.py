"""Block-hash values are a stable contract (prefix hits across requests compare them): pinned digests,
and every hashing path (``hash_block``, ``hash_at`` via ``chain``, list and array sources) agrees."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.kv_groups.hashing import BlockHasher

TOKENS = [(i * 7919) % 50257 for i in range(40)]

# blake2b keys of blocks 0, 2, 4 of TOKENS with block_size 8, computed before the hashing was optimised.
PINNED = {
    b"": ["1225746ede7b787f45f4523614026aec", "601fbff2cfe7ee2c902a7650a1f02392",
          "2af7b3e11d93b6c3af4ab01c6abf5f19"],
    b"tenant": ["653939d20ea6f6fb25b151039b5ff605", "ca578d2c0dc6cf17ae262f70220a9458",
                "a12aff9a5becfcb16e29c72186feb5b9"],
}


@pytest.mark.parametrize("salt", list(PINNED))
def test_blake2b_chain_is_pinned(salt: bytes) -> None:
    chain = BlockHasher(block_size=8, salt=salt).chain(TOKENS)
    assert [h.hex() for h in chain[::2]] == PINNED[salt]  # type: ignore[union-attr]


def test_builtin_chain_is_the_tuple_hash() -> None:
    h = BlockHasher(block_size=8, algorithm="builtin")
    parent, expect = h.root, []
    for i in range(len(TOKENS) // 8):
        parent = hash((parent, *TOKENS[i * 8:(i + 1) * 8]))
        expect.append(parent)
    assert h.chain(TOKENS) == expect


@pytest.mark.parametrize("algorithm", ["blake2b", "builtin"])
def test_all_paths_agree(algorithm: str) -> None:
    h = BlockHasher(block_size=8, algorithm=algorithm, salt=b"s")  # type: ignore[arg-type]
    chain = h.chain(TOKENS)
    assert chain == [h.hash_block(p, TOKENS[i * 8:(i + 1) * 8]) for i, p in enumerate([h.root, *chain[:-1]])]
    for source in (TOKENS, h.source(np.array(TOKENS, np.int32))):
        assert [h.hash_at(p, source, i) for i, p in enumerate([h.root, *chain[:-1]])] == chain

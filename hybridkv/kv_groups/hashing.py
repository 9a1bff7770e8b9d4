"""Chained block hashes: the prefix-cache key of a block is ``hash(parent_hash, tokens of the block)``.

Chaining makes a block's key stand for the whole prefix up to the block's end, so equal keys mean equal
KV (same tokens at the same positions) and a lookup never compares tokens.

Collision stance. The default, ``"blake2b"``, is a 128-bit cryptographic digest of the parent digest and
the block's tokens as little-endian int64: we treat collisions as impossible (2^64 work for a birthday
collision), which matters when several tenants share one prefix cache and one of them could try to
poison another's cache. ``"builtin"`` is Python's tuple hash (64-bit, deterministic for ints across runs
and processes, about 2x faster): fine for a single tenant, accidental collisions ~n^2 / 2^65, but it is
not collision resistant against crafted input. A ``salt`` (e.g. per tenant or per LoRA adapter) starts
the chain from a different root, so caches of different salts never match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

BlockHash = bytes | int
TokenSeq = Sequence[int] | np.ndarray
TokenSource = Sequence[int] | memoryview

_DIGEST = 16
_I64 = np.dtype("<i8")
_blake2b = hashlib.blake2b
# Copying an empty 16-byte-digest state and feeding parent and block is faster than building one from
# ``parent + block`` with keyword arguments, and streams the same bytes (same digest).
_new_state = hashlib.blake2b(digest_size=_DIGEST).copy


@dataclass(frozen=True, kw_only=True)
class BlockHasher:
    """Hashes the full ``block_size``-token blocks of a token sequence, each chained to its parent."""

    block_size: int
    algorithm: Literal["blake2b", "builtin"] = "blake2b"
    salt: bytes = b""
    root: BlockHash = field(init=False)
    _pack: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"BlockHasher.block_size must be positive, got {self.block_size}")
        if self.algorithm not in ("blake2b", "builtin"):
            raise ValueError(f"BlockHasher.algorithm must be 'blake2b' or 'builtin', got {self.algorithm!r}")
        seed = hashlib.blake2b(b"hybridkv/block-hash/v1:" + self.salt, digest_size=_DIGEST).digest()
        root: BlockHash = seed if self.algorithm == "blake2b" else int.from_bytes(seed[:8], "little")
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "_pack", struct.Struct(f"<{self.block_size}q"))

    def hash_block(self, parent: BlockHash, tokens: TokenSeq) -> BlockHash:
        """Key of one block of exactly ``block_size`` tokens whose prefix has key ``parent``."""
        if self.algorithm == "builtin":
            toks = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
            return hash((parent, *toks))
        if isinstance(tokens, np.ndarray):
            data = (tokens if tokens.dtype == _I64 else tokens.astype(_I64)).tobytes()
        else:
            data = self._pack.pack(*tokens)
        return _blake2b(parent + data, digest_size=_DIGEST).digest()  # type: ignore[operator]

    def source(self, tokens: TokenSeq) -> TokenSource:
        """What ``hash_at`` reads: an int64 memoryview of an array (no per-block numpy slicing; an
        int64 C-contiguous array is viewed, not copied, so later writes into it are seen), or the
        sequence itself (a list the engine appends to stays live)."""
        if isinstance(tokens, np.ndarray):
            return memoryview(np.ascontiguousarray(tokens, dtype=_I64))
        return tokens

    def hash_at(self, parent: BlockHash, source: TokenSource, index: int) -> BlockHash:
        """Key of block ``index`` of ``source`` (see ``source``) whose prefix has key ``parent``."""
        bs = self.block_size
        block = source[index * bs:(index + 1) * bs]
        if self.algorithm == "builtin":
            return hash((parent, *(block.tolist() if type(block) is memoryview else block)))
        state = _new_state()
        state.update(parent)  # type: ignore[arg-type]
        state.update(block if type(block) is memoryview else self._pack.pack(*block))
        return state.digest()

    def extend(self, hashes: list[BlockHash], tokens: TokenSeq | TokenSource, num_blocks: int) -> None:
        """Append keys to ``hashes`` (the chain of ``tokens``' first blocks) until it has ``num_blocks``."""
        bs = self.block_size
        if num_blocks * bs > len(tokens):
            raise ValueError(f"cannot hash {num_blocks} blocks of {bs} tokens from {len(tokens)} tokens")
        first = len(hashes)
        if first >= num_blocks:
            return
        parent = hashes[-1] if hashes else self.root
        if self.algorithm == "blake2b" and num_blocks - first > 1:
            # Several blocks: their little-endian int64 bytes in one conversion, then one digest per block
            # (the bytes hash_at streams, without a pack and a call per block).
            data = memoryview(np.asarray(tokens[first * bs:num_blocks * bs], dtype=_I64)).cast("B")
            width = 8 * bs
            new, append = _new_state, hashes.append
            for off in range(0, len(data), width):
                state = new()
                state.update(parent)  # type: ignore[arg-type]
                state.update(data[off:off + width])
                parent = state.digest()
                append(parent)
            return
        source = self.source(tokens) if isinstance(tokens, np.ndarray) else tokens
        for i in range(first, num_blocks):
            parent = self.hash_at(parent, source, i)
            hashes.append(parent)

    def chain(self, tokens: TokenSeq, num_blocks: int | None = None) -> list[BlockHash]:
        """Keys of the first ``num_blocks`` full blocks of ``tokens`` (all full blocks by default)."""
        out: list[BlockHash] = []
        self.extend(out, tokens, len(tokens) // self.block_size if num_blocks is None else num_blocks)
        return out

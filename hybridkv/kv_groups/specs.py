"""Per-layer KV-cache specs: what each layer kind stores, and how much of it a request needs.

A spec is a frozen, hashable value. Layers with equal specs share a group (and a block table), so
everything that decides memory layout lives here and nothing else.

Token accounting (docs/design.md, "Semantics"), for a request with ``n`` computed tokens:

=================  ==========================  ==========================================
kind               skipped tokens              per-request upper bound (blocks)
=================  ==========================  ==========================================
full               0                           cdiv(len, bs)
sliding window W   max(0, n - W + 1)           cdiv(min(W - 1 + step, len), bs) + 1
chunked local C    (n // C) * C                cdiv(min(C + step, len), bs)
mamba              n - 1                       1 state slot
kv shared          the donor's                 0 (it reads the donor's blocks)
=================  ==========================  ==========================================

"Skipped" tokens are never read again; a block whose tokens are all skipped is freed. ``step`` is the
number of tokens the request computes in one step (1 when decoding).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridkv.utils import cdiv

DEFAULT_BLOCK_SIZE = 16


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(ABC):
    """What one layer keeps per request. ``block_size`` is the token granularity of its block table
    (for Mamba: the granularity of prefix-cache checkpoints, so hybrid hits line up)."""

    kind: ClassVar[str]
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size)

    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one layer stores for one block (attention) or one state slot (Mamba)."""

    @abstractmethod
    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens whose cache entries no future query reads, once ``num_computed`` are done."""

    @abstractmethod
    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        """Blocks (or slots) a request of ``num_tokens`` can hold at once while computing
        ``step_tokens`` tokens in one step: the bound used for admission and sizing."""

    def steady_blocks_per_request(self, num_tokens: int) -> int:
        """What one running request holds while decoding (one token per step)."""
        return self.max_blocks_per_request(num_tokens=num_tokens, step_tokens=1)

    def transient_blocks_per_step(self, step_tokens: int) -> int:
        """Extra blocks a prefill chunk of ``step_tokens`` holds beyond the steady need, for one step.

        The chunk's early tokens fall out of the window/chunk once the step is done, so this extra is
        transient and bounded by the step's token budget: admission reserves it once per step, not once
        per request (docs/design.md, "Beyond existing runtimes")."""
        big = 1 << 40
        return (self.max_blocks_per_request(num_tokens=big, step_tokens=step_tokens)
                - self.max_blocks_per_request(num_tokens=big, step_tokens=1))

    @property
    def is_attention(self) -> bool:
        return True

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec, ABC):
    """Paged K and V: ``block_size`` tokens x ``num_kv_heads`` x ``head_size`` each, per layer. ``kv_planes``:
    how many such planes a block holds (K and V: 2; MLA's one latent row: 1)."""

    kv_planes: ClassVar[int] = 2
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(type(self).__name__, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        if not self.dtype.is_floating_point:
            raise ValueError(f"{type(self).__name__}.dtype must be a floating dtype, got {self.dtype}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, one layer."""
        return self.kv_planes * self.num_kv_heads * self.head_size * _itemsize(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def as_full_attention(self) -> FullAttentionSpec:
        """The same cache allocated as full attention (the yardstick the plan compares against)."""
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, dtype=self.dtype)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "full"

    def skipped_tokens(self, num_computed: int) -> int:
        return 0

    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2, Kimi-Linear): full attention whose cache holds, per token, one row
    shared by every head, [latent (``kv_lora_rank``) | rope key (``qk_rope_head_dim``)], instead of per-head K and
    V: one plane of ``num_kv_heads=1`` x ``head_size=kv_lora_rank + qk_rope_head_dim``. The layer reads it as both
    the keys and (its first ``kv_lora_rank`` channels) the values of the absorbed form (``layers/mla.py``)."""

    kind: ClassVar[str] = "full"
    kv_planes: ClassVar[int] = 1
    kv_lora_rank: int
    qk_rope_head_dim: int
    num_kv_heads: int = 1
    head_size: int = 0          # derived: kv_lora_rank + qk_rope_head_dim

    def __post_init__(self) -> None:
        _check_positive("MLAAttentionSpec", kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)
        row = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_size not in (0, row) or self.num_kv_heads != 1:
            raise ValueError(f"MLAAttentionSpec: one row of kv_lora_rank + qk_rope_head_dim = {row} per token "
                             f"(num_kv_heads=1, head_size={row}), got num_kv_heads={self.num_kv_heads}, "
                             f"head_size={self.head_size}")
        object.__setattr__(self, "head_size", row)
        super().__post_init__()

    def as_full_attention(self) -> FullAttentionSpec:
        return self                 # already full attention, at its own (latent) size

    def describe(self) -> str:
        return f"mla({self.kv_lora_rank}+{self.qk_rope_head_dim})"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """HF semantics: a query at p sees keys p - W < k <= p (W keys, itself included)."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("SlidingWindowSpec", sliding_window=self.sliding_window)

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.sliding_window + 1)

    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        # The window rarely starts on a block boundary, hence the extra block.
        live = min(self.sliding_window - 1 + step_tokens, num_tokens)
        return min(cdiv(live, self.block_size) + 1, cdiv(num_tokens, self.block_size))

    def describe(self) -> str:
        return f"sliding_window({self.sliding_window})"


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Llama-4 local attention: a query at p sees keys k <= p with k // C == p // C.

    C must be a multiple of ``block_size``: then every chunk starts on a block boundary, the
    local-attention transform can start a virtual request's block-table row at the chunk's first
    block, and no block is shared by two chunks. We raise rather than handle unaligned chunks."""

    kind: ClassVar[str] = "chunked_local"
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("ChunkedLocalAttentionSpec", attention_chunk_size=self.attention_chunk_size)
        if self.attention_chunk_size % self.block_size:
            raise ValueError(
                f"ChunkedLocalAttentionSpec.attention_chunk_size={self.attention_chunk_size} is not a "
                f"multiple of block_size={self.block_size}; choose a block size that divides the chunk")

    def skipped_tokens(self, num_computed: int) -> int:
        return (num_computed // self.attention_chunk_size) * self.attention_chunk_size

    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        live = min(self.attention_chunk_size + step_tokens, num_tokens)
        return min(cdiv(live, self.block_size), cdiv(num_tokens, self.block_size))

    def describe(self) -> str:
        return f"chunked_local({self.attention_chunk_size})"


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A fixed-size recurrent state per request, e.g. conv state + SSM state of one Mamba2 layer.

    ``shapes[i]`` / ``dtypes[i]`` describe one state tensor of one request (no batch dim); the SSM
    state is fp32 by convention because it accumulates over the whole sequence."""

    kind: ClassVar[str] = "mamba"
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(f"MambaSpec needs one dtype per state shape, got shapes={self.shapes} "
                             f"dtypes={self.dtypes}")
        for shape in self.shapes:
            if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(f"MambaSpec.shapes must hold positive int dims, got {shape}")

    @property
    def bytes_per_block(self) -> int:
        return sum(math.prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def is_attention(self) -> bool:
        return False

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - 1)

    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        return 1

    def describe(self) -> str:
        return "mamba(" + " + ".join("x".join(map(str, s)) for s in self.shapes) + ")"


@dataclass(frozen=True, kw_only=True)
class KVSharingSpec(KVCacheSpec):
    """A layer that keeps no cache of its own but reads another layer's (cross-layer KV sharing: Gemma-3n /
    Gemma-4's last ``num_kv_shared_layers`` layers reuse the KV of an earlier layer of their attention kind).

    ``donor`` names the layer whose cache it reads and ``target`` is the donor's spec (what the reader's queries
    attend over, window included). The plan puts the reader in the donor's group: it allocates no page, writes
    no KV and its attention reads the donor's blocks through the group's table."""

    kind: ClassVar[str] = "kv_shared"
    donor: str
    target: AttentionSpec

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.donor, str) or not self.donor:
            raise ValueError(f"KVSharingSpec.donor must name a layer, got {self.donor!r}")
        if not isinstance(self.target, AttentionSpec):
            raise ValueError(f"KVSharingSpec.target must be the donor's attention spec, got {self.target!r}")
        if self.block_size != self.target.block_size:
            raise ValueError(f"KVSharingSpec.block_size={self.block_size} differs from its donor's "
                             f"{self.target.block_size}")

    @property
    def bytes_per_block(self) -> int:
        return 0

    def skipped_tokens(self, num_computed: int) -> int:
        return self.target.skipped_tokens(num_computed)

    def max_blocks_per_request(self, *, num_tokens: int, step_tokens: int) -> int:
        return 0

    def describe(self) -> str:
        return f"shares {self.donor} ({self.target.describe()})"

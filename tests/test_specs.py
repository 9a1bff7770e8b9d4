"""Worked examples for the per-kind specs (docs/design.md, "Semantics"): skipped tokens, per-request bounds, transient
per-step blocks, and bad input (the error names the field)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from tests._kv_helpers import chunked, full, mamba, sliding

# (spec, num_computed, skipped tokens)
SKIPPED = [
    (full(4), 0, 0), (full(4), 100, 0),
    (sliding(4), 0, 0), (sliding(4), 3, 0), (sliding(4), 4, 1), (sliding(4), 10, 7),   # keys n-W+1 .. n
    (sliding(1), 5, 5),                                                                 # sees only itself
    (chunked(8), 0, 0), (chunked(8), 7, 0), (chunked(8), 8, 8), (chunked(8), 17, 16),
    (mamba(4), 0, 0), (mamba(4), 1, 0), (mamba(4), 9, 8),
]


@pytest.mark.parametrize(("spec", "n", "want"), SKIPPED, ids=lambda v: getattr(v, "kind", str(v)))
def test_skipped_tokens(spec: KVCacheSpec, n: int, want: int) -> None:
    assert spec.skipped_tokens(n) == want


# (spec, num_tokens, step_tokens, max blocks per request)
BOUNDS = [
    (full(16), 33, 1, 3), (full(16), 32, 2048, 2),
    # sliding: cdiv(min(W - 1 + step, len), bs) + 1, never above cdiv(len, bs)
    (sliding(1024, 16), 32768, 1, 65), (sliding(1024, 16), 32768, 2048, 193),
    (sliding(4096, 16), 32768, 2048, 385), (sliding(1024, 16), 100, 1, 7), (sliding(4, 4), 4, 1, 1),
    # chunked: cdiv(min(C + step, len), bs)
    (chunked(8192, 16), 32768, 1, 513), (chunked(8192, 16), 32768, 2048, 640), (chunked(8, 4), 6, 1, 2),
    (mamba(16), 1 << 20, 2048, 1),
]


@pytest.mark.parametrize(("spec", "length", "step", "want"), BOUNDS, ids=lambda v: getattr(v, "kind", str(v)))
def test_max_blocks_per_request(spec: KVCacheSpec, length: int, step: int, want: int) -> None:
    assert spec.max_blocks_per_request(num_tokens=length, step_tokens=step) == want


@pytest.mark.parametrize(("spec", "step", "want"), [
    (full(16), 2048, 0), (mamba(16), 2048, 0),
    (sliding(1024, 16), 2048, 128), (sliding(1024, 16), 1, 0),     # 193 - 65
    (chunked(8192, 16), 2048, 127), (chunked(8192, 16), 16, 0),   # 640 - 513
])
def test_transient_blocks_per_step(spec: KVCacheSpec, step: int, want: int) -> None:
    assert spec.transient_blocks_per_step(step) == want


def test_steady_is_decode_bound() -> None:
    s = sliding(1024, 16)
    assert s.steady_blocks_per_request(32768) == s.max_blocks_per_request(num_tokens=32768, step_tokens=1)


def test_bytes() -> None:
    s = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert s.bytes_per_token == 2 * 8 * 128 * 2 and s.bytes_per_block == 16 * s.bytes_per_token
    m = MambaSpec(shapes=((4, 3), (2, 5)), dtypes=(torch.bfloat16, torch.float32))
    assert m.bytes_per_block == 12 * 2 + 10 * 4 and not m.is_attention
    assert sliding(8).as_full_attention() == full(4)


def test_equal_specs_are_equal_values() -> None:
    assert sliding(8) == sliding(8) and hash(sliding(8)) == hash(sliding(8)) and sliding(8) != sliding(9)
    assert sliding(8).describe() == "sliding_window(8)" and chunked(8).describe() == "chunked_local(8)"


ATTN = dict(num_kv_heads=1, head_size=4)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: SlidingWindowSpec(sliding_window=0, **ATTN), "sliding_window"),
    (lambda: SlidingWindowSpec(sliding_window=-3, **ATTN), "sliding_window"),
    (lambda: SlidingWindowSpec(sliding_window=True, **ATTN), "sliding_window"),
    (lambda: ChunkedLocalAttentionSpec(attention_chunk_size=0, **ATTN), "attention_chunk_size"),
    (lambda: ChunkedLocalAttentionSpec(attention_chunk_size=-16, **ATTN), "attention_chunk_size"),
    (lambda: ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=24, **ATTN),
     "attention_chunk_size"),
    (lambda: FullAttentionSpec(block_size=0, **ATTN), "block_size"),
    (lambda: FullAttentionSpec(num_kv_heads=0, head_size=4), "num_kv_heads"),
    (lambda: FullAttentionSpec(num_kv_heads=1, head_size=-1), "head_size"),
    (lambda: FullAttentionSpec(dtype=torch.int8, **ATTN), "dtype"),
    (lambda: MambaSpec(shapes=((2, 2),), dtypes=()), "dtype"),
    (lambda: MambaSpec(shapes=((2, 0),), dtypes=(torch.float32,)), "shapes"),
])
def test_bad_input_names_the_field(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        make()


def test_unaligned_chunk_error_says_block_size() -> None:
    with pytest.raises(ValueError, match=r"attention_chunk_size=24 is not a multiple of block_size=16"):
        ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=24, **ATTN)

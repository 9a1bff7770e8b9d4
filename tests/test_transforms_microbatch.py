"""Microbatch slicing: vLLM's ubatch tables, every field against an independent rebuild, and the invariant
concat(split outputs) == unsplit output, alone and composed with local attention and window trimming."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from _cam_helpers import (
    assert_cam_equal,
    assert_close,
    batch_specs,
    dense_attention,
    make_batch,
    poison_unreferenced,
    run_paged,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import (
    compose,
    make_local_attention_virtual_batches,
    slice_microbatch,
    split_microbatches,
    trim_sliding_window,
)
from hybridkv.utils import cdiv


def spec_cam(seq_lens, query_lens, block_size=16):
    ncols = max(cdiv(s, block_size) for s in seq_lens)
    bt = 1 + np.arange(len(seq_lens) * ncols).reshape(len(seq_lens), ncols)
    return CommonAttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_table=bt, block_size=block_size
    )


def test_docstring_example():
    cam = spec_cam([3, 9], [3, 7], block_size=2)
    a, b = split_microbatches(cam, [6])
    assert a.query_lens_cpu.tolist() == [3, 3] and a.seq_lens_cpu.tolist() == [3, 5]
    assert b.query_lens_cpu.tolist() == [4] and b.seq_lens_cpu.tolist() == [9]
    assert b.num_computed_tokens_cpu.tolist() == [5]


# Inputs from vLLM's test_attention_splitting.py (BATCH_SPECS small_decode / mixed_small / large_decode);
# expected values derived by hand.
def test_slice_first_decode():
    cam = spec_cam([32, 40], [1, 1])
    part = slice_microbatch(cam, 0, 1)
    assert (part.num_reqs, part.num_actual_tokens, part.max_query_len) == (1, 1, 1)
    assert part.query_start_loc.tolist() == [0, 1] and part.seq_lens.tolist() == [32]


def test_slice_middle_of_mixed_batch():
    cam = spec_cam([32, 40, 48, 56], [1, 1, 5, 5])
    part = slice_microbatch(cam, 1, 7)  # requests 1-2, tokens 1-7
    assert (part.num_reqs, part.num_actual_tokens, part.max_query_len) == (2, 6, 5)
    assert part.query_start_loc.tolist() == [0, 1, 6] and part.seq_lens.tolist() == [40, 48]
    assert_cam_equal(split_microbatches(cam, [1, 7])[1], part)


def test_split_large_decode_in_half():
    cam = spec_cam([2048] * 32, [1] * 32)
    first, second = split_microbatches(cam, num_ubatches=2)
    for part in (first, second):
        assert part.num_reqs == part.num_actual_tokens == 16
        assert part.seq_lens.tolist() == [2048] * 16


@pytest.mark.parametrize(
    ("split", "first_reqs", "second_reqs", "first_seq", "second_seq"),
    [(12, 2, 1, [32, 36], [40]), (4, 1, 2, [28], [32, 40])],
)
def test_prefill_cut_across_microbatches(split, first_reqs, second_reqs, first_seq, second_seq):
    """seq_lens [32, 40], query_lens [8, 8]: the cut request's first part stops at the cut."""
    cam = spec_cam([32, 40], [8, 8])
    a, b = split_microbatches(cam, [split])
    assert (a.num_reqs, b.num_reqs) == (first_reqs, second_reqs)
    assert (a.num_actual_tokens, b.num_actual_tokens) == (split, 16 - split)
    assert a.seq_lens_cpu.tolist() == first_seq and b.seq_lens_cpu.tolist() == second_seq
    assert a.query_lens_cpu[-1] + b.query_lens_cpu[0] == 8


def expected_part(cam: CommonAttentionMetadata, t0: int, t1: int) -> CommonAttentionMetadata:
    """The part rebuilt independently (per-request Python, via build): the slicer must match every field."""
    qsl = cam.query_start_loc_cpu
    q, s, rows, ks = [], [], [], []
    for r in range(cam.num_reqs):
        a, b = int(qsl[r]), int(qsl[r + 1])
        # a request without queries belongs to the part starting at its offset (or the last part)
        empty_inside = t0 <= a < t1 or a == t1 == cam.num_actual_tokens
        inside = empty_inside if a == b else a < t1 and b > t0
        if not inside:
            continue
        lo, hi = max(a, t0), min(b, t1)
        q.append(hi - lo)
        s.append(int(cam.seq_lens_cpu[r]) - (b - hi))
        rows.append(cam.block_table_cpu[r])
        ks.append(int(cam.key_start_cpu[r]))
    part = CommonAttentionMetadata.build(
        query_lens=q,
        seq_lens=s,
        block_table=np.array(rows),
        block_size=cam.block_size,
        key_start=ks,
        causal=cam.causal,
    )
    return part


@pytest.mark.slow       # attention over every split point of 40 random batches
@settings(max_examples=40, deadline=None)
@given(spec=batch_specs(max_reqs=4, max_len=16), seed=st.integers(0, 2**16))
def test_every_split_point_matches_unsplit(spec, seed):
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed)
    full = run_paged(b, b.cam)
    for t in range(1, b.cam.num_actual_tokens):
        parts = split_microbatches(b.cam, [t])
        for part, (t0, t1) in zip(parts, [(0, t), (t, b.cam.num_actual_tokens)], strict=True):
            part.validate()
            assert_cam_equal(part, expected_part(b.cam, t0, t1))
        assert_close(run_paged(b, parts), full)


@settings(max_examples=60, deadline=None)
@given(spec=batch_specs(), n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_balanced_ubatches(spec, n, seed):
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed)
    n = min(n, b.cam.num_actual_tokens)
    parts = split_microbatches(b.cam, num_ubatches=n)
    sizes = [p.num_actual_tokens for p in parts]
    assert len(parts) == n and sum(sizes) == b.cam.num_actual_tokens and max(sizes) - min(sizes) <= 1
    assert_close(run_paged(b, parts), run_paged(b, b.cam))


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    spec=batch_specs(max_reqs=4, max_len=16),
    chunk_blocks=st.integers(1, 3),
    window=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_split_composes_with_local_and_trim_in_both_orders(spec, chunk_blocks, window, seed):
    q_lens, s_lens, bs = spec
    chunk = bs * chunk_blocks
    b = make_batch(q_lens, s_lens, bs, seed)
    local = partial(make_local_attention_virtual_batches, attn_chunk_size=chunk)
    trim = partial(trim_sliding_window, sliding_window=window)
    want_local = dense_attention(b, chunk=chunk)
    want_window = dense_attention(b, window=window)
    for t in range(1, b.cam.num_actual_tokens):
        split = partial(split_microbatches, token_splits=[t])
        # split after transform
        assert_close(run_paged(b, compose(local, split)(b.cam)), want_local)
        after = compose(trim, split)(b.cam)
        k, v = poison_unreferenced(b, *after)
        assert_close(run_paged(b, after, k, v, sliding_window=window), want_window)
        # transform after split
        assert_close(run_paged(b, compose(split, local)(b.cam)), want_local)
        before = compose(split, trim)(b.cam)
        k, v = poison_unreferenced(b, *before)
        assert_close(run_paged(b, before, k, v, sliding_window=window), want_window)


def test_zero_query_requests_are_kept_once():
    cam = spec_cam([4, 3, 5, 2], [0, 3, 0, 2], block_size=2)
    """A request without queries (padding) goes to the part starting at its offset, exactly once."""
    parts = split_microbatches(cam, [2, 3])
    assert [p.query_lens_cpu.tolist() for p in parts] == [[0, 2], [1], [0, 2]]
    assert [p.seq_lens_cpu.tolist() for p in parts] == [[4, 2], [3], [5, 2]]
    for part in parts:
        part.validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"token_splits": [3], "num_ubatches": 2},
        {"token_splits": [0]},
        {"token_splits": [7]},
        {"token_splits": [3, 3]},
        {"token_splits": [5, 2]},
        {"token_splits": [2.5]},
        {"token_splits": [[1, 2]]},
        {"num_ubatches": 0},
        {"num_ubatches": 8},
        {"num_ubatches": 2.0},
    ],
)
def test_rejects_bad_splits(kwargs):
    cam = spec_cam([5, 4], [4, 3], block_size=2)
    with pytest.raises(ValueError, match="token_splits|num_ubatches"):
        split_microbatches(cam, **kwargs)


@pytest.mark.parametrize(("t0", "t1"), [(0, 0), (3, 2), (-1, 2), (0, 8)])
def test_slice_rejects_bad_range(t0, t1):
    with pytest.raises(ValueError, match="token_start"):
        slice_microbatch(spec_cam([5, 4], [4, 3], block_size=2), t0, t1)


def test_empty_token_splits_returns_the_batch_and_input_is_untouched():
    cam = spec_cam([5, 4], [4, 3], block_size=2)
    before = cam.seq_lens_cpu.copy()
    (only,) = split_microbatches(cam, [])
    assert_cam_equal(only, cam)
    split_microbatches(cam, [2, 5])
    assert np.array_equal(cam.seq_lens_cpu, before) and cam.seq_lens.tolist() == before.tolist()

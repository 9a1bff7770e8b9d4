"""Sliding-window trimming: the docstring example, the no-dead-block invariant, attention with poisoned
unreferenced blocks, and composition with a non-zero input key_start."""

from __future__ import annotations

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
from hybridkv.transforms import make_local_attention_virtual_batches, split_microbatches, trim_sliding_window


def docstring_cam() -> CommonAttentionMetadata:
    return CommonAttentionMetadata.build(
        query_lens=[1, 3, 3],
        seq_lens=[7, 5, 8],
        block_table=[[10, 11, 12, 13], [20, 21, 22, 0], [30, 31, 32, 33]],
        block_size=2,
    )


def test_trim_docstring_example():
    cam = docstring_cam()
    out = trim_sliding_window(cam, 3)
    out.validate()
    assert out.seq_lens_cpu.tolist() == [3, 5, 6]
    assert out.key_start_cpu.tolist() == [4, 0, 2]
    assert out.num_computed_tokens_cpu.tolist() == [2, 2, 3]
    assert out.block_table_cpu.tolist() == [[12, 13, 0], [20, 21, 22], [31, 32, 33]]
    assert out.query_start_loc_cpu is cam.query_start_loc_cpu and out.slot_mapping is cam.slot_mapping
    assert cam.seq_lens_cpu.tolist() == [7, 5, 8]  # input untouched


def test_nothing_to_drop_returns_input():
    cam = docstring_cam()
    assert trim_sliding_window(cam, 100) is cam


def assert_no_dead_blocks(cam: CommonAttentionMetadata, window: int) -> None:
    """Every referenced block holds a key some query of its row sees, and the first one is needed."""
    bs = cam.block_size
    first_visible = np.maximum(cam.num_computed_tokens_cpu - window + 1, 0)  # relative to key_start
    for r in range(cam.num_reqs):
        if cam.query_lens_cpu[r] == 0:
            continue
        nblk = -(-int(cam.seq_lens_cpu[r]) // bs)
        last_key_of_block = np.minimum((np.arange(nblk) + 1) * bs, cam.seq_lens_cpu[r]) - 1
        assert (last_key_of_block >= first_visible[r]).all(), f"row {r} references a dead block"
        assert first_visible[r] < bs, f"row {r} could drop more"
        assert not cam.block_table_cpu[r, nblk:].any(), f"row {r} references blocks past its keys"


@settings(max_examples=100, deadline=None)
@given(spec=batch_specs(), window=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_trim_attention_equals_dense_window_with_poisoned_blocks(spec, window, seed):
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed, extra_cols=seed % 2)
    trimmed = trim_sliding_window(b.cam, window)
    trimmed.validate()
    assert_no_dead_blocks(trimmed, window)
    k, v = poison_unreferenced(b, trimmed)
    assert_close(run_paged(b, trimmed, k, v, sliding_window=window), dense_attention(b, window=window))
    # idempotent, and a narrower window on top equals trimming to it directly
    assert trim_sliding_window(trimmed, window) is trimmed
    narrower = max(1, window // 2)
    assert_cam_equal(trim_sliding_window(trimmed, narrower), trim_sliding_window(b.cam, narrower))


@settings(max_examples=100, deadline=None)
@given(
    spec=batch_specs(), window=st.integers(1, 24), chunk_blocks=st.integers(1, 4), seed=st.integers(0, 2**16)
)
def test_trim_after_local_attention(spec, window, chunk_blocks, seed):
    """Input key_start is already non-zero (virtual batches start at their chunk): trimming must compose."""
    q_lens, s_lens, bs = spec
    chunk = bs * chunk_blocks
    b = make_batch(q_lens, s_lens, bs, seed)
    both = trim_sliding_window(make_local_attention_virtual_batches(b.cam, chunk), window)
    both.validate()
    assert_no_dead_blocks(both, window)
    k, v = poison_unreferenced(b, both)
    assert_close(
        run_paged(b, both, k, v, sliding_window=window), dense_attention(b, window=window, chunk=chunk)
    )


def test_trim_after_split_trims_the_second_part_further():
    cam = CommonAttentionMetadata.build(
        query_lens=[8], seq_lens=[8], block_table=[[1, 2, 3, 4]], block_size=2
    )
    first, second = split_microbatches(cam, [4])
    assert trim_sliding_window(first, 2) is first  # earliest query at 0: nothing to drop
    t = trim_sliding_window(second, 2)  # earliest query at 4 sees 3, 4: drop block [0, 1]
    assert t.key_start_cpu.tolist() == [2] and t.block_table_cpu.tolist() == [[2, 3, 4]]


@pytest.mark.parametrize("window", [0, -3, 2.5, True, None])
def test_rejects_bad_window(window):
    with pytest.raises(ValueError, match="sliding_window"):
        trim_sliding_window(docstring_cam(), window)

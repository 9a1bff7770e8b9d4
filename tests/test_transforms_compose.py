"""compose(): left-to-right order, identity, mapping over list-returning stages."""

from __future__ import annotations

from functools import partial

import pytest
from _cam_helpers import assert_cam_equal

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import (
    compose,
    make_local_attention_virtual_batches,
    split_microbatches,
    trim_sliding_window,
)


def cam() -> CommonAttentionMetadata:
    return CommonAttentionMetadata.build(
        query_lens=[4, 10, 5],
        seq_lens=[6, 17, 9],
        block_table=[[1 + 9 * r + j for j in range(9)] for r in range(3)],
        block_size=2,
    )


def test_identity_and_order():
    c = cam()
    assert compose()(c) is c
    local = partial(make_local_attention_virtual_batches, attn_chunk_size=4)
    trim = partial(trim_sliding_window, sliding_window=3)
    assert_cam_equal(compose(local, trim)(c), trim(local(c)))
    assert_cam_equal(compose(trim, local)(c), local(trim(c)))


def test_stages_after_a_list_are_mapped_over_the_parts():
    c = cam()
    local = partial(make_local_attention_virtual_batches, attn_chunk_size=4)
    parts = compose(partial(split_microbatches, num_ubatches=2), local)(c)
    assert isinstance(parts, list) and len(parts) == 2
    for got, part in zip(parts, split_microbatches(c, num_ubatches=2), strict=True):
        assert_cam_equal(got, local(part))
    nested = compose(
        partial(split_microbatches, num_ubatches=2), partial(split_microbatches, num_ubatches=2)
    )(c)
    assert len(nested) == 4 and sum(p.num_actual_tokens for p in nested) == c.num_actual_tokens


def test_rejects_non_callable():
    with pytest.raises(ValueError, match="transforms"):
        compose(trim_sliding_window, 3)

"""Decode/prefill split and reordering: vLLM's tables (our stable-order expectations) and permutation
invariance of attention."""

from __future__ import annotations

import numpy as np
import pytest
from _cam_helpers import assert_cam_equal, assert_close, batch_specs, make_batch, run_paged
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops import paged_attention_ref
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import permute_requests, reorder_decodes_first, split_decodes_and_prefills


def cam_for(query_lens, seq_lens=None):
    seq_lens = seq_lens or [10 * (i + 1) for i in range(len(query_lens))]
    width = max(-(-s // 16) for s in seq_lens)
    bt = 1 + np.arange(len(seq_lens) * width).reshape(len(seq_lens), width)
    return CommonAttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_table=bt, block_size=16
    )


def test_docstring_example():
    assert split_decodes_and_prefills(cam_for([1, 1, 2, 1, 7, 1, 4]), 2) == (4, 3, 5, 12)


# Inputs from vLLM's test_attention_splitting.py (seq_lens 10, 20, ...); expectations derived by hand.
@pytest.mark.parametrize(
    ("query_lens", "threshold", "uniform", "expected"),
    [
        ([1, 1, 1], 1, False, (3, 0, 3, 0)),
        ([1, 2, 1, 3, 2, 1, 2], 3, False, (7, 0, 12, 0)),
        ([4, 5, 6, 7], 3, False, (0, 4, 0, 22)),
        ([2, 1, 3, 4, 5, 6, 7, 8], 4, False, (4, 4, 10, 26)),
        ([1, 1, 1], 1, True, (3, 0, 3, 0)),
        ([2, 2, 1, 3, 2, 1, 2], 3, True, (2, 5, 4, 9)),
        ([4, 5, 6, 7], 3, True, (0, 4, 0, 22)),
        ([2, 2, 2, 4, 5, 6, 7, 8], 4, True, (3, 5, 6, 30)),
        ([2, 1, 2, 4, 5, 6, 7, 8], 4, True, (1, 7, 2, 33)),
    ],
)
def test_split_decodes_and_prefills_table(query_lens, threshold, uniform, expected):
    cam = cam_for(query_lens)
    assert split_decodes_and_prefills(cam, threshold, require_uniform=uniform) == expected


def test_split_empty_batch():
    cam = CommonAttentionMetadata.build(query_lens=[], seq_lens=[], block_table=[], block_size=16)
    assert split_decodes_and_prefills(cam) == (0, 0, 0, 0)


# Inputs from vLLM's test_batch_reordering.py as (query_len, num_computed); vLLM minimises swaps, we
# promise a *stable* order, so the expected permutations are ours.
REORDER_CASES = {
    "all_decodes": ([(1, 10), (1, 20), (1, 30)], 1, [0, 1, 2]),
    "all_prefills": ([(100, 100), (200, 200), (300, 300)], 1, [0, 1, 2]),
    "mixed_interleaved": ([(100, 100), (1, 10), (200, 200), (1, 20)], 1, [1, 3, 0, 2]),
    "already_ordered": ([(1, 10), (1, 20), (100, 100), (200, 0)], 1, [0, 1, 2, 3]),
    "single_request": ([(1, 10)], 1, [0]),
    "higher_threshold": ([(2, 10), (3, 20), (5, 30), (6, 40)], 4, [0, 1, 2, 3]),
    "decodes_at_end": ([(100, 100), (200, 200), (1, 10), (1, 20)], 1, [2, 3, 0, 1]),
    "decode_extend_prefill": ([(100, 0), (10, 50), (1, 10)], 1, [2, 0, 1]),
    "extend_prefill_only": ([(100, 0), (10, 50), (200, 0), (20, 75)], 1, [0, 1, 2, 3]),
    "complicated_mixed_interleaved": (
        [(1, 20), (1, 50), (374, 0), (300, 20), (1, 20), (256, 0), (1, 5), (27, 0), (1, 4)],
        1,
        [0, 1, 4, 6, 8, 2, 3, 5, 7],
    ),
}


@pytest.mark.parametrize("case", list(REORDER_CASES), ids=list(REORDER_CASES))
def test_reorder_decodes_first_table(case):
    requests, threshold, expected = REORDER_CASES[case]
    query_lens = [q for q, _ in requests]
    perm = reorder_decodes_first(query_lens, threshold)
    assert perm.tolist() == expected
    cam = cam_for(query_lens, [q + c for q, c in requests])
    reordered, _ = permute_requests(cam, perm)
    num_decodes = sum(q <= threshold for q in query_lens)
    assert split_decodes_and_prefills(reordered, threshold)[0] == num_decodes


@settings(max_examples=60, deadline=None)
@given(spec=batch_specs(max_reqs=6), seed=st.integers(0, 2**16), threshold=st.integers(1, 4))
def test_permuted_batch_gives_permuted_outputs(spec, seed, threshold):
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed)
    perm = reorder_decodes_first(b.cam.query_lens_cpu, threshold)
    new, token_index = permute_requests(b.cam, perm)
    new.validate()
    rebuilt = CommonAttentionMetadata.build(
        query_lens=np.array(q_lens)[perm],
        seq_lens=np.array(s_lens)[perm],
        block_table=b.cam.block_table_cpu[perm],
        block_size=bs,
    )
    assert_cam_equal(new, rebuilt)
    out = paged_attention_ref(b.q[token_index], b.k_cache, b.v_cache, new, scale=b.scale)
    assert_close(out, run_paged(b, b.cam)[token_index])
    nd, npf, ndt, npt = split_decodes_and_prefills(new, threshold)
    assert nd == int((np.array(q_lens) <= threshold).sum()) and nd + npf == len(q_lens)
    assert ndt + npt == new.num_actual_tokens


@pytest.mark.parametrize("threshold", [0, -1, 1.5, True])
def test_rejects_bad_threshold(threshold):
    with pytest.raises(ValueError, match="decode_threshold"):
        split_decodes_and_prefills(cam_for([1, 2]), threshold)
    with pytest.raises(ValueError, match="decode_threshold"):
        reorder_decodes_first([1, 2], threshold)


@pytest.mark.parametrize("perm", [[0], [0, 0, 1], [0, 1, 3], [2, 1, 0.0], [[0, 1, 2]]])
def test_rejects_bad_permutation(perm):
    with pytest.raises(ValueError, match="perm"):
        permute_requests(cam_for([1, 2, 3]), perm)


def test_reorder_rejects_2d():
    with pytest.raises(ValueError, match="query_lens"):
        reorder_decodes_first([[1, 2]])

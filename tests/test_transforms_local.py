"""Local-attention virtual batches: worked examples, vLLM's tables (our conventions), attention equality."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from _cam_helpers import assert_cam_equal, assert_close, batch_specs, dense_attention, make_batch, run_paged
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import (
    make_local_attention_virtual_batches,
    make_local_attention_virtual_batches_device,
    max_local_virtual_batches,
    trim_sliding_window,
)
from hybridkv.utils import cdiv


def arange_cam(query_lens, seq_lens, block_size, ncols=None):
    """Block ids 1 + r * ncols + column (0 stays the null block), so tables can be asserted literally."""
    ncols = ncols or max(cdiv(s, block_size) for s in seq_lens)
    bt = 1 + np.arange(len(seq_lens) * ncols).reshape(len(seq_lens), ncols)
    return CommonAttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_table=bt, block_size=block_size
    )


# (query_lens, seq_lens, chunk, block_size, ncols, expected q_lens, k_lens, key_start, block table)
# The first is docs/design.md's worked example (and the module docstring); the others are the inputs of vLLM's
# test_chunked_local_attention.py with expectations derived by hand for our conventions: columns past a
# virtual request's last key hold the null block 0 (vLLM repeats the last id), and the table is as wide as
# the widest virtual row (vLLM pads to C // block_size columns).
VIRTUAL_CASES = {
    "design_worked_example": (
        [4, 10, 5],
        [6, 17, 9],
        4,
        2,
        9,
        [2, 2, 1, 4, 4, 1, 4, 1],
        [4, 2, 4, 4, 4, 1, 4, 1],
        [0, 4, 4, 8, 12, 16, 4, 8],
        [[1, 2], [3, 0], [12, 13], [14, 15], [16, 17], [18, 0], [21, 22], [23, 0]],
    ),
    "last_block_full": ([8], [12], 4, 2, None, [4, 4], [4, 4], [4, 8], [[3, 4], [5, 6]]),
    "all_kv_involved": ([7], [10], 4, 2, None, [1, 4, 2], [4, 4, 2], [0, 4, 8], [[1, 2], [3, 4], [5, 0]]),
    "chunk_larger_than_seq": ([4], [6], 10, 2, None, [4], [6], [0], [[1, 2, 3]]),
    "block_equals_chunk": (
        [6, 6],
        [8, 8],
        4,
        4,
        None,
        [2, 4, 2, 4],
        [4, 4, 4, 4],
        [0, 4, 0, 4],
        [[1], [2], [3], [4]],
    ),
    "query_in_second_chunk": ([1], [5], 4, 2, None, [1], [1], [4], [[3]]),
}


@pytest.mark.parametrize("case", list(VIRTUAL_CASES), ids=list(VIRTUAL_CASES))
def test_virtual_batch_tables(case):
    q, s, chunk, bs, ncols, exp_q, exp_k, exp_start, exp_bt = VIRTUAL_CASES[case]
    cam = arange_cam(q, s, bs, ncols)
    out = make_local_attention_virtual_batches(cam, chunk)
    out.validate()
    assert out.query_lens_cpu.tolist() == exp_q
    assert out.seq_lens_cpu.tolist() == exp_k
    assert out.key_start_cpu.tolist() == exp_start
    assert out.block_table_cpu.tolist() == exp_bt
    assert out.slot_mapping is cam.slot_mapping  # token order is unchanged
    assert (out.query_lens_cpu <= chunk).all() and (out.seq_lens_cpu <= chunk).all()


# vLLM's test_max_local_attention_virtual_batches_bounds_num_reqs inputs; counts derived by hand
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "chunk", "max_num_seqs", "expected"),
    [
        ([1000], [1000], 256, 1, 4),
        ([1000], [1255], 256, 1, 5),
        ([300, 700, 90], [300, 1400, 90], 128, 4, 10),
        ([64, 64], [64, 64], 256, 2, 2),
        ([1, 1, 1, 1], [16, 32, 48, 64], 16, 4, 4),
    ],
)
def test_virtual_batch_count_and_bound(query_lens, seq_lens, chunk, max_num_seqs, expected):
    cam = arange_cam(query_lens, seq_lens, 16)
    out = make_local_attention_virtual_batches(cam, chunk)
    assert out.num_reqs == expected
    bound = max_local_virtual_batches(chunk, max_num_seqs, sum(query_lens))
    assert out.num_reqs <= bound
    assert sum(cdiv(int(k), 16) for k in out.seq_lens_cpu) <= bound * (chunk // 16)


@settings(max_examples=100, deadline=None)
@given(spec=batch_specs(), chunk_blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_virtual_batches_attention_equals_dense_chunked(spec, chunk_blocks, seed):
    q_lens, s_lens, bs = spec
    chunk = bs * chunk_blocks
    b = make_batch(q_lens, s_lens, bs, seed)
    local = make_local_attention_virtual_batches(b.cam, chunk)
    local.validate()
    assert_close(run_paged(b, local), dense_attention(b, chunk=chunk))
    # idempotent: every virtual request already lies inside one chunk
    assert_cam_equal(make_local_attention_virtual_batches(local, chunk), local)


@settings(max_examples=60, deadline=None)
@given(
    spec=batch_specs(), chunk_blocks=st.integers(1, 4), extra=st.integers(0, 3), seed=st.integers(0, 2**16)
)
def test_device_form_equals_host_form(spec, chunk_blocks, extra, seed):
    q_lens, s_lens, bs = spec
    chunk = bs * chunk_blocks
    b = make_batch(q_lens, s_lens, bs, seed, extra_cols=extra)
    host = make_local_attention_virtual_batches(b.cam, chunk)
    v_max = max_local_virtual_batches(chunk, b.cam.num_reqs, b.cam.num_actual_tokens)
    dev = make_local_attention_virtual_batches_device(b.cam, chunk, v_max)
    dev.validate()  # host twins agree with the device fields, padding included
    n = host.num_reqs
    assert dev.num_reqs == v_max >= n
    assert torch.equal(dev.query_start_loc[: n + 1], host.query_start_loc)
    assert (dev.query_start_loc[n:] == host.num_actual_tokens).all()
    assert torch.equal(dev.seq_lens[:n], host.seq_lens) and not dev.seq_lens[n:].any()
    assert torch.equal(dev.key_start[:n], host.key_start) and not dev.key_start[n:].any()
    nblk = -(-host.seq_lens_cpu // bs)  # the columns a kernel reads must agree; the rest is null
    for r in range(n):
        assert torch.equal(dev.block_table_tensor[r, : nblk[r]], host.block_table_tensor[r, : nblk[r]])
        assert not dev.block_table_tensor[r, nblk[r] :].any()
    assert not dev.block_table_tensor[n:].any()
    assert_close(run_paged(b, dev), dense_attention(b, chunk=chunk))


def test_device_form_has_static_shapes_and_no_sync(monkeypatch):
    """Run the device half on the meta device: .item(), .cpu() or a data-dependent shape would raise."""
    monkeypatch.setenv("HYBRIDKV_DEBUG", "0")  # validate() would read the (data-less) meta tensors
    cam = arange_cam([4, 10, 5], [6, 17, 9], 2, 9)
    meta = dataclasses.replace(
        cam,
        **{
            f: getattr(cam, f).to("meta")
            for f in ("query_start_loc", "seq_lens", "key_start", "block_table_tensor", "slot_mapping")
        },
    )
    out = make_local_attention_virtual_batches_device(meta, 4, 12)
    assert out.block_table_tensor.device.type == "meta"
    assert tuple(out.block_table_tensor.shape) == (12, 2) and tuple(out.query_start_loc.shape) == (13,)


def test_rejects_trimmed_input_missing_the_chunk():
    cam = arange_cam([1], [8], 2)
    trimmed = trim_sliding_window(cam, 2)  # query at 7 keeps keys from 6 on; its chunk starts at 4
    assert trimmed.key_start_cpu.tolist() == [6]
    with pytest.raises(ValueError, match="key_start"):
        make_local_attention_virtual_batches(trimmed, 4)
    assert make_local_attention_virtual_batches(trimmed, 2).key_start_cpu.tolist() == [6]


@pytest.mark.parametrize("chunk", [0, -4, 3, 2.0, True, None])
def test_rejects_bad_chunk(chunk):
    cam = arange_cam([4, 10, 5], [6, 17, 9], 2, 9)
    with pytest.raises(ValueError, match="attn_chunk_size"):
        make_local_attention_virtual_batches(cam, chunk)
    with pytest.raises(ValueError, match="attn_chunk_size"):
        make_local_attention_virtual_batches_device(cam, chunk, 16)


def test_device_form_rejects_too_small_bound():
    cam = arange_cam([4, 10, 5], [6, 17, 9], 2, 9)
    with pytest.raises(ValueError, match="max_virtual_reqs"):
        make_local_attention_virtual_batches_device(cam, 4, 7)


def test_requests_without_queries_make_no_virtual_request():
    cam = arange_cam([0, 3, 0], [4, 5, 0], 2)
    out = make_local_attention_virtual_batches(cam, 4)
    assert out.query_lens_cpu.tolist() == [2, 1] and out.seq_lens_cpu.tolist() == [4, 1]
    dev = make_local_attention_virtual_batches_device(cam, 4, 4)
    dev.validate()
    assert dev.seq_lens.tolist() == [4, 1, 0, 0]


def _cuda_batch(seed: int, n: int = 8, bs: int = 4, width: int = 12) -> CommonAttentionMetadata:
    rng = np.random.default_rng(seed)
    s = rng.integers(1, width * bs + 1, n)
    q = np.minimum(rng.integers(1, 20, n), s)
    bt = rng.permutation(n * width).reshape(n, width) + 1
    return CommonAttentionMetadata.build(
        query_lens=q, seq_lens=s, block_table=bt, block_size=bs, device="cuda"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_form_has_no_sync_and_replays_in_a_cuda_graph():
    chunk = 16
    static = _cuda_batch(0)
    v_max = max_local_virtual_batches(chunk, static.num_reqs, static.num_reqs * 20)
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync raises
    try:
        make_local_attention_virtual_batches_device(static, chunk, v_max)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        make_local_attention_virtual_batches_device(static, chunk, v_max)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = make_local_attention_virtual_batches_device(static, chunk, v_max)
    names = ("query_start_loc", "seq_lens", "key_start", "block_table_tensor")
    for seed in range(1, 6):  # new batches through the same static buffers
        new = _cuda_batch(seed)
        for name in names:
            getattr(static, name).copy_(getattr(new, name))
        graph.replay()
        want = make_local_attention_virtual_batches_device(new, chunk, v_max)
        host = make_local_attention_virtual_batches(new, chunk)
        for name in names:
            assert torch.equal(getattr(out, name), getattr(want, name)), name
        n = host.num_reqs
        assert out.seq_lens[:n].tolist() == host.seq_lens_cpu.tolist() and not out.seq_lens[n:].any()


def test_empty_batch_through_every_transform():
    cam = CommonAttentionMetadata.build(query_lens=[], seq_lens=[], block_table=[], block_size=4)
    assert make_local_attention_virtual_batches(cam, 8).num_reqs == 0
    dev = make_local_attention_virtual_batches_device(cam, 8, 3)
    dev.validate()
    assert dev.seq_lens.tolist() == [0, 0, 0]
    assert trim_sliding_window(cam, 3) is cam

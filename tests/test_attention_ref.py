"""paged_attention_ref / write_kv_ref against the dense oracle (contiguous K/V + explicit mask)."""

from __future__ import annotations

import pytest
import torch
from _cam_helpers import assert_close, batch_specs, dense_attention, make_batch, poison_unreferenced
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops import paged_attention_ref, write_kv_ref
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import make_local_attention_virtual_batches, trim_sliding_window


@settings(max_examples=100, deadline=None)
@given(
    spec=batch_specs(),
    seed=st.integers(0, 2**16),
    kv_heads=st.sampled_from([1, 2, 4]),
    window=st.one_of(st.none(), st.integers(1, 20)),
    softcap=st.one_of(st.none(), st.sampled_from([0.5, 30.0])),
)
def test_paged_equals_dense(spec, seed, kv_heads, window, softcap):
    """Cache starts as NaN: any read outside the referenced slots would show up in the output."""
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=4, num_kv_heads=kv_heads, extra_cols=seed % 3)
    out = paged_attention_ref(
        b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale, sliding_window=window, softcap=softcap
    )
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert_close(out, dense_attention(b, window=window, softcap=softcap))


@settings(max_examples=60, deadline=None)
@given(
    spec=batch_specs(),
    seed=st.integers(0, 2**16),
    kv_heads=st.sampled_from([1, 2, 4]),
    mask=st.sampled_from(["causal", "window", "trimmed_window", "local_chunks"]),
    size=st.integers(1, 12),
    softcap=st.one_of(st.none(), st.sampled_from([0.5, 30.0])),
)
def test_sinks_equal_dense_with_sinks(spec, seed, kv_heads, mask, size, softcap):
    """gpt-oss sinks (magnitudes 1-3, both signs) against the oracle's extra softmax column, alone and with a
    window (untrimmed and trimmed), local-attention virtual batches (each virtual request's rows get the sink,
    as every row does) and softcap; blocks no transformed row references are NaN."""
    q_lens, s_lens, bs = spec
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=4, num_kv_heads=kv_heads, extra_cols=seed % 3)
    g = torch.Generator().manual_seed(seed)
    sinks = (1 + 2 * torch.rand(4, generator=g)) * (torch.randint(0, 2, (4,), generator=g) * 2 - 1)
    cam, window, chunk = b.cam, None, None
    if mask in ("window", "trimmed_window"):
        window = size
        cam = trim_sliding_window(cam, window) if mask == "trimmed_window" else cam
    elif mask == "local_chunks":
        chunk = bs * max(1, size // bs)           # a chunk starts on a block boundary
        cam = make_local_attention_virtual_batches(cam, chunk)
    kc, vc = poison_unreferenced(b, cam)
    out = paged_attention_ref(b.q, kc, vc, cam, scale=b.scale, sliding_window=window, softcap=softcap, sinks=sinks)
    assert_close(out, dense_attention(b, window=window, chunk=chunk, softcap=softcap, sinks=sinks))


def test_sinks_take_weight_and_a_very_negative_sink_takes_none():
    b = make_batch([3, 1, 6], [5, 9, 6], 2, seed=4)
    plain = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale)
    big = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale, sinks=torch.full((4,), 3.0))
    none = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale, sinks=torch.full((4,), -1e4))
    assert (big - plain).abs().max() > 0.1                     # the sink takes a share of every softmax
    assert big.norm() < plain.norm()                           # ... and gives no value back
    assert_close(none, plain)


def test_output_dtype_follows_q():
    b = make_batch([3, 1], [5, 9], 4, seed=1)
    out = paged_attention_ref(b.q.to(torch.float64), b.k_cache, b.v_cache, b.cam, scale=b.scale)
    assert out.dtype == torch.float64
    assert_close(out.float(), dense_attention(b))


def test_non_causal_sees_every_key():
    b = make_batch([4], [4], 2, seed=3)
    cam = CommonAttentionMetadata.build(
        query_lens=[4], seq_lens=[4], block_table=b.cam.block_table_cpu, block_size=2, causal=False
    )
    out = paged_attention_ref(b.q, b.k_cache, b.v_cache, cam, scale=b.scale)
    k = b.k_dense[0].repeat_interleave(2, 1)
    v = b.v_dense[0].repeat_interleave(2, 1)
    probs = torch.softmax(torch.einsum("nhd,khd->hnk", b.q, k) * b.scale, -1)
    assert_close(out, torch.einsum("hnk,khd->nhd", probs, v))


def test_write_kv_ref_writes_slots():
    k_cache = torch.zeros(3, 2, 1, 1)
    v_cache = torch.zeros(3, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    write_kv_ref(k, -k, k_cache, v_cache, torch.tensor([5, 0, 2]))
    assert k_cache.view(-1).tolist() == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]
    assert v_cache.view(-1).tolist() == [-2.0, 0.0, -3.0, 0.0, 0.0, -1.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"q": torch.zeros(2, 4, 8)}, "q"),
        ({"q": torch.zeros(4, 3, 8)}, "num_heads"),
        ({"k_cache": torch.zeros(9, 4, 2, 8)}, "k_cache"),
        ({"sinks": torch.zeros(3)}, "sinks"),
    ],
)
def test_bad_inputs(kwargs, match):
    b = make_batch([3, 1], [5, 9], 2, seed=2)
    args = {"q": b.q, "k_cache": b.k_cache, "v_cache": b.v_cache, "sliding_window": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        paged_attention_ref(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), b.cam, scale=1.0, **args)

"""Triton paged attention and KV write against the torch reference and the dense oracle.

On a machine without CUDA the kernels run under Triton's interpreter (``tests/_triton.py``) at tiny sizes.
With CUDA, the same checks run compiled, plus bf16 checks marked ``gpu``.
Skipped with a reason when triton is not importable.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from _cam_helpers import dense_attention, make_batch, poison_unreferenced
from _triton import DEVICE, HAS_CUDA, gpu, kernel_module

from hybridkv.layers.ops.attention_ref import paged_attention_ref, write_kv_ref
from hybridkv.layers.ops.fused_ref import QKPrep, rope_attention_ref
from hybridkv.layers.rotary import rope_inv_freq
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.models.config import Rope
from hybridkv.transforms import (
    make_local_attention_virtual_batches,
    make_local_attention_virtual_batches_device,
    trim_sliding_window,
)

ta = kernel_module("hybridkv.backends.triton_attention")
find_request = ta.find_request
import triton  # noqa: E402  (after kernel_module: it skips this module without triton)
import triton.language as tl  # noqa: E402


def _random_spec(rng: np.random.Generator, max_reqs: int, max_len: int) -> tuple[list[int], list[int]]:
    """A mix of decodes, prefills and chunked prefills."""
    q_lens, s_lens = [], []
    for _ in range(int(rng.integers(1, max_reqs + 1))):
        kind = rng.choice(["decode", "prefill", "chunked"])
        s = int(rng.integers(2, max_len + 1))
        q = 1 if kind == "decode" else s if kind == "prefill" else int(rng.integers(1, s))
        q_lens.append(q)
        s_lens.append(s)
    return q_lens, s_lens


def _to(batch_tensor: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return batch_tensor.to(device=DEVICE, dtype=dtype)


def _cam_to(cam: CommonAttentionMetadata) -> CommonAttentionMetadata:
    if DEVICE == "cpu":
        return cam
    return cam.replace(query_start_loc=cam.query_start_loc.to(DEVICE), seq_lens=cam.seq_lens.to(DEVICE),
                       key_start=cam.key_start.to(DEVICE), block_table_tensor=cam.block_table_tensor.to(DEVICE),
                       slot_mapping=cam.slot_mapping.to(DEVICE))


def _run(q, k, v, cam, **kw):
    """Kernel output with the output buffer poisoned first (every element must be written)."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    ta.paged_attention_triton(q, k, v, _cam_to(cam), out=out, **kw)
    return out


def _strided_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy into a (num_blocks, 2, bs, kv_heads, d) pool and return the strided K/V views, like the engine."""
    pool = torch.stack([k_cache, v_cache], dim=1).to(DEVICE).contiguous()
    return pool[:, 0], pool[:, 1]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-4) -> None:
    assert not torch.isnan(actual).any(), "NaN in output: unwritten output or a poisoned block was read"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# (seed, block_size, num_heads, num_kv_heads, head_dim, window, softcap, num_segments)
CASES = [
    (0, 1, 4, 2, 16, None, None, 1),
    (1, 2, 4, 4, 16, None, 30.0, 1),
    (2, 3, 6, 2, 16, 5, None, 1),       # non-power-of-two block size and GQA group (3)
    (3, 4, 4, 1, 32, None, None, 2),    # split-KV
    (4, 8, 5, 1, 16, 7, 0.5, 1),        # group 5 (Llama-4-like), window + softcap
    (5, 16, 4, 2, 24, None, None, 4),   # head_dim padded 24 -> 32, split-KV
    (6, 16, 8, 2, 16, 3, None, 2),      # window + split
    (7, 2, 2, 1, 256, None, None, 32),  # more segments than the reduction reads per trip (16 at d = 256)
]


@pytest.mark.parametrize("graph_split", [False, True])
@pytest.mark.parametrize(("seed", "bs", "heads", "kv_heads", "d", "window", "softcap", "segs"), CASES)
def test_matches_reference_and_oracle(seed, bs, heads, kv_heads, d, window, softcap, segs, graph_split, monkeypatch):
    """``graph_split``: the split count compiled in, as under CUDA-graph capture (eager steps pass it at run
    time)."""
    monkeypatch.setattr(ta, "capturing", lambda t: graph_split)
    rng = np.random.default_rng(seed)
    q_lens, s_lens = _random_spec(rng, max_reqs=4, max_len=40)
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                   extra_cols=seed % 3)
    kc, vc = poison_unreferenced(b, b.cam)                  # unreferenced blocks (null block 0 too) are NaN
    ref = paged_attention_ref(b.q, kc, vc, b.cam, scale=b.scale, sliding_window=window, softcap=softcap)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, b.cam, scale=b.scale, sliding_window=window, softcap=softcap,
               num_segments=segs)
    _assert_close(out, ref)
    _assert_close(out, dense_attention(b, window=window, softcap=softcap))


@pytest.mark.parametrize("seed", range(20, 36))
def test_random_batches(seed):
    """Fresh random shapes per seed: block size 1-16, GQA group 1-4, window / softcap / split-KV."""
    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 17))
    kv_heads = int(rng.choice([1, 2]))
    heads = kv_heads * int(rng.integers(1, 5))
    d = int(rng.choice([16, 32]))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 24))
    softcap = None if rng.random() < 0.6 else float(rng.choice([0.5, 20.0]))
    segs = int(rng.choice([1, 1, 2, 4]))
    q_lens, s_lens = _random_spec(rng, max_reqs=5, max_len=48)
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                   extra_cols=seed % 2)
    cam = trim_sliding_window(b.cam, window) if window is not None and seed % 2 else b.cam
    kc, vc = poison_unreferenced(b, cam)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale, sliding_window=window, softcap=softcap, num_segments=segs)
    _assert_close(out, dense_attention(b, window=window, softcap=softcap))


@pytest.mark.parametrize(("window", "segs"), [(None, None), (20, None), (None, 4), (20, 2)])
def test_decode_at_head_dim_256(window, segs):
    """Gemma's d = 256 decode path (16-key tiles, split-KV chosen by the grid on a GPU): every row one query,
    rows of 1 to 70 keys over blocks of 16, a trimmed window."""
    s_lens = [1, 17, 40, 70]
    b = make_batch([1] * len(s_lens), s_lens, 16, 7, num_heads=4, num_kv_heads=1, head_dim=256, extra_cols=1)
    assert ta.launch_config(head_dim=256, group=4, max_query_len=1)["TILE"] == 16
    cam = trim_sliding_window(b.cam, window) if window is not None else b.cam
    kc, vc = poison_unreferenced(b, cam)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale, sliding_window=window, num_segments=segs)
    _assert_close(out, dense_attention(b, window=window))


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """gpt-oss-like sink logits: magnitudes 1-3, both signs."""
    g = torch.Generator().manual_seed(seed)
    return (1 + 2 * torch.rand(heads, generator=g)) * (torch.randint(0, 2, (heads,), generator=g) * 2 - 1)


# (seed, block_size, heads, kv_heads, d, mask, softcap, num_segments): sinks alone, with a trimmed window, with
# local-attention virtual batches, with softcap; unsplit (the epilogue adds the sink) and split (the reduction
# does, once: 8 segments over rows of a few tiles leave most segments empty)
SINK_CASES = [
    (40, 4, 4, 2, 16, None, None, 1),
    (41, 4, 4, 2, 16, None, None, 2),
    (42, 2, 6, 2, 16, ("window", 5), None, 1),
    (43, 2, 6, 2, 16, ("window", 5), None, 8),
    (44, 4, 4, 1, 32, ("chunk", 8), None, 1),
    (45, 4, 4, 1, 32, ("chunk", 8), 20.0, 4),
    (46, 3, 8, 8, 16, None, 0.5, 2),
]


@pytest.mark.parametrize("graph_split", [False, True])
@pytest.mark.parametrize(("seed", "bs", "heads", "kv_heads", "d", "mask", "softcap", "segs"), SINK_CASES)
def test_sinks_match_reference_and_oracle(seed, bs, heads, kv_heads, d, mask, softcap, segs, graph_split,
                                          monkeypatch):
    """Attention sinks (HAS_SINKS) against the dense oracle's extra softmax column and the reference, on caches
    whose blocks no (transformed) row references are NaN; ``graph_split``: the split count compiled in."""
    monkeypatch.setattr(ta, "capturing", lambda t: graph_split)
    rng = np.random.default_rng(seed)
    q_lens, s_lens = _random_spec(rng, max_reqs=4, max_len=40)
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, extra_cols=1)
    sinks = _sinks(heads, seed)
    window = mask[1] if mask and mask[0] == "window" else None
    chunk = mask[1] if mask and mask[0] == "chunk" else None
    cam = trim_sliding_window(b.cam, window) if window else (
        make_local_attention_virtual_batches(b.cam, chunk) if chunk else b.cam)
    kc, vc = poison_unreferenced(b, cam)
    want = dense_attention(b, window=window, chunk=chunk, softcap=softcap, sinks=sinks)
    ref = paged_attention_ref(b.q, kc, vc, cam, scale=b.scale, sliding_window=window, softcap=softcap, sinks=sinks)
    _assert_close(ref, want)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale, sliding_window=window, softcap=softcap, sinks=_to(sinks),
               num_segments=segs)
    _assert_close(out, want)
    assert (want - dense_attention(b, window=window, chunk=chunk, softcap=softcap)).abs().max() > 1e-2


@pytest.mark.parametrize("segs", [1, 4, 128])
def test_sinks_decode_with_empty_segments_and_padding(segs, monkeypatch):
    """A decode batch (one masked loop per request) with a padding request and rows much shorter than the split:
    empty segments carry no sink (the reduction adds it once); the workspace starts NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    b = make_batch([1, 1, 1], [2, 40, 17], 16, 6, num_heads=4, num_kv_heads=1, head_dim=16)
    bt = np.insert(b.cam.block_table_cpu, 1, 0, axis=0)
    cam = CommonAttentionMetadata.build(query_lens=[1, 0, 1, 1], seq_lens=[2, 0, 40, 17], block_table=bt,
                                        block_size=16)
    kc, vc = poison_unreferenced(b, b.cam)
    k, v = _strided_pool(kc, vc)
    sinks = _sinks(4, segs)
    _assert_close(_run(_to(b.q), k, v, cam, scale=b.scale, sinks=_to(sinks), num_segments=segs),
                  dense_attention(b, sinks=sinks))


def test_sinks_bad_shape():
    b = make_batch([3, 1], [5, 9], 2, seed=2, head_dim=16)
    with pytest.raises(ValueError, match="sinks"):
        ta.paged_attention_triton(b.q, b.k_cache, b.v_cache, b.cam, scale=1.0, sinks=torch.zeros(3))


@pytest.mark.parametrize(("d", "segs"), [(16, 8), (256, 8), (16, 128)])
def test_empty_segments_read_no_workspace(monkeypatch, d, segs):
    """Rows much shorter than the split (as in a graph captured for a long max_model_len) leave segments
    without keys: they write only their (max, sum) pair and the reduction skips their accumulators. Every
    workspace starts NaN, so a skipped write that is read shows up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    s_lens = [1, 3, 17, 40]
    b = make_batch([1] * len(s_lens), s_lens, 16, 3, num_heads=4, num_kv_heads=1, head_dim=d)
    kc, vc = poison_unreferenced(b, b.cam)
    k, v = _strided_pool(kc, vc)
    _assert_close(_run(_to(b.q), k, v, b.cam, scale=b.scale, num_segments=segs), dense_attention(b))


@pytest.mark.parametrize("seed", [10, 11])
def test_trimmed_sliding_window(seed):
    """After trimming, blocks wholly outside every window are NaN; the kernel must not read them."""
    rng = np.random.default_rng(seed)
    window, bs = 4, 2
    q_lens, s_lens = _random_spec(rng, max_reqs=4, max_len=30)
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=4, num_kv_heads=2, head_dim=16)
    cam = trim_sliding_window(b.cam, window)
    kc, vc = poison_unreferenced(b, cam)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale, sliding_window=window)
    _assert_close(out, dense_attention(b, window=window))


@pytest.mark.parametrize("device_variant", [False, True])
def test_local_attention_virtual_batches(device_variant):
    """Chunked-local attention = the causal kernel on virtual batches (host and padded device variants)."""
    chunk, bs = 8, 4
    q_lens, s_lens = [1, 13, 5, 20], [19, 21, 9, 20]
    b = make_batch(q_lens, s_lens, bs, 7, num_heads=4, num_kv_heads=2, head_dim=16)
    if device_variant:
        cam = make_local_attention_virtual_batches_device(b.cam, chunk, 12)   # padded with empty requests
    else:
        cam = make_local_attention_virtual_batches(b.cam, chunk)
    kc, vc = poison_unreferenced(b, cam)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale)
    _assert_close(out, dense_attention(b, chunk=chunk))


def test_non_causal_and_empty_requests():
    b = make_batch([4, 3], [4, 3], 2, 3, num_heads=2, num_kv_heads=1, head_dim=16)
    cam = CommonAttentionMetadata.build(query_lens=[4, 0, 3], seq_lens=[4, 0, 3],
                                        block_table=np.insert(b.cam.block_table_cpu, 1, 0, axis=0),
                                        block_size=2, causal=False)
    kc, vc = _strided_pool(b.k_cache, b.v_cache)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, cam, scale=b.scale)
    _assert_close(_run(_to(b.q), kc, vc, cam, scale=b.scale), ref)


@pytest.mark.parametrize("segs", [1, 2, 8])
def test_decode_batch_with_padding_request(segs):
    """A decode-only batch (program i = request i, one masked key loop) with a padding request of no query
    token, as a captured graph's padded batch has, with and without split-KV; a second launch is bit-equal."""
    b = make_batch([1, 1, 1], [9, 30, 17], 4, 5, num_heads=4, num_kv_heads=2, head_dim=16)
    bt = np.insert(b.cam.block_table_cpu, 1, 0, axis=0)
    cam = CommonAttentionMetadata.build(query_lens=[1, 0, 1, 1], seq_lens=[9, 0, 30, 17], block_table=bt,
                                        block_size=4)
    assert cam.max_query_len == 1
    kc, vc = poison_unreferenced(b, b.cam)
    k, v = _strided_pool(kc, vc)
    first = _run(_to(b.q), k, v, cam, scale=b.scale, num_segments=segs)
    _assert_close(first, dense_attention(b))
    assert torch.equal(_run(_to(b.q), k, v, cam, scale=b.scale, num_segments=segs), first)


ROPE_PREPS = {  # name -> (QKPrep kwargs, rope); rot_dim for head_dim 16
    "neox": (dict(rot_dim=16), Rope(theta=10000.0)),
    "neox_partial_qk_norm_gemma": (dict(rot_dim=8, qk_norm="rms", gemma_norm=True),
                                   Rope(theta=10000.0, partial_rotary_factor=0.5)),
    "llama4_rope": (dict(rot_dim=16, interleaved=True, qk_norm="rms_weightless"),
                    Rope(theta=500000.0, interleaved=True)),
    "llama4_nope": (dict(temperature_tuning=(0.1, 8.0)), None),
}
# Gemma-4's global layers (d = 512): proportional RoPE over the whole head (its partial factor zeroes frequencies)
GEMMA4_GLOBAL_PREP = (dict(rot_dim=512, qk_norm="rms", gemma_norm=True),
                      Rope(theta=1e6, scaling="proportional", partial_rotary_factor=0.25))


def _rope_attention_both(q, k, v, positions, kc, vc, slots, cam, kw, *, segs: int | None = None):
    """``rope_attention`` by the reference (on copies of ``kc`` / ``vc``) and by the Triton op (on a strided pool made
    from them); returns (got, want, got cache, want cache)."""
    want_k, want_v = kc.clone(), vc.clone()
    want = rope_attention_ref(q, k, v, positions, k_cache=want_k, v_cache=want_v, slot_mapping=slots, cam=cam, **kw)
    k_dev, v_dev = _strided_pool(kc, vc)
    dev = {key: _to(t) if isinstance(t, torch.Tensor) else t for key, t in kw.items()}
    got = ta.rope_attention_triton(_to(q), _to(k), _to(v), positions.to(DEVICE), k_cache=k_dev, v_cache=v_dev,
                                   slot_mapping=slots.to(DEVICE), cam=_cam_to(cam), num_segments=segs, **dev)
    return got, want, (k_dev, v_dev), (want_k, want_v)


def _rope_attention_case(name: str, *, window: int | None, chunk: int | None, segs: int | None, seed: int,
                         heads: int = 4, kv_heads: int = 2, d: int = 16, long: int = 40, sinks: bool = False):
    """A decode batch with a padding request, raw q/k/v, and a cache whose new-token slots are NaN: the fused
    op must prepare q and k, write k and v, and attend; returns (got, want, got cache, want cache). ``name``: a
    key of ``ROPE_PREPS`` or "gemma4_global"."""
    prep_kw, rope = GEMMA4_GLOBAL_PREP if name == "gemma4_global" else ROPE_PREPS[name]
    s_lens = [3, 21, 9, long]
    b = make_batch([1] * len(s_lens), s_lens, 4, seed, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                   extra_cols=1)
    bt = np.insert(b.cam.block_table_cpu, 2, 0, axis=0)
    cam = CommonAttentionMetadata.build(query_lens=[1, 1, 0, 1, 1], seq_lens=[3, 21, 0, 9, long], block_table=bt,
                                        block_size=4)
    if window is not None:
        cam = trim_sliding_window(cam, window)
    if chunk is not None:
        cam = make_local_attention_virtual_batches_device(cam, chunk, 12)
    kc, vc = poison_unreferenced(b, b.cam)
    slots = b.cam.slot_mapping
    kc.view(-1, kv_heads, d)[slots] = float("nan")                  # the op writes them
    vc.view(-1, kv_heads, d)[slots] = float("nan")
    g = torch.Generator().manual_seed(seed)
    n = len(s_lens)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    positions = torch.tensor(s_lens) - 1 + torch.tensor([0, 7, 1000, 123456])      # absolute, any offset
    prep = QKPrep(head_dim=d, eps=1e-6, **prep_kw)
    kw = dict(prep=prep, inv_freq=rope_inv_freq(rope, prep.rot_dim) if rope is not None else None,
              q_norm_weight=torch.randn(d, generator=g) * 0.3 + 1, k_norm_weight=torch.randn(d, generator=g) * 0.3 + 1,
              scale=b.scale, sliding_window=window, sinks=_sinks(heads, seed) if sinks else None)
    return _rope_attention_both(q, k, v, positions, kc, vc, slots, cam, kw, segs=segs)


@pytest.mark.parametrize("segs", [1, 2, 8])
@pytest.mark.parametrize("name", sorted(ROPE_PREPS))
def test_rope_attention_decode_is_one_fused_launch(name, segs):
    """Decode: q/k norm + RoPE (or NoPE temperature) + KV write inside the attention kernel == the
    reference's qk_rope_write_kv then paged_attention, output and cache. The longest row spans 4 key tiles of
    64, so with 2 or 8 segments the new key's writer is a later segment and other segments read full tiles."""
    got, want, (k_got, v_got), (k_want, v_want) = _rope_attention_case(name, window=None, chunk=None, segs=segs,
                                                                       seed=segs, long=230)
    _assert_close(got, want)
    torch.testing.assert_close(k_got.cpu(), k_want, equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_got.cpu(), v_want, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize(("window", "chunk"), [(6, None), (None, 8)])
def test_rope_attention_decode_window_and_local_chunks(window, chunk):
    """The new key's slot stays the token's own under a trimmed window table and local-attention virtual
    batches (whose positions restart per chunk while RoPE reads the absolute ones)."""
    got, want, (k_got, _), (k_want, _) = _rope_attention_case("llama4_rope", window=window, chunk=chunk, segs=2,
                                                              seed=9)
    _assert_close(got, want)
    torch.testing.assert_close(k_got.cpu(), k_want, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "chunk", "segs"), [(None, None, 1), (6, None, 2), (None, 8, 8)])
def test_rope_attention_decode_with_sinks(window, chunk, segs):
    """gpt-oss decode: the fused kernel (q/k prep, KV write, attention) with sinks, unsplit and split, alone,
    under a trimmed window and over local-attention virtual batches."""
    got, want, (k_got, _), (k_want, _) = _rope_attention_case("neox", window=window, chunk=chunk, segs=segs, seed=11,
                                                              long=150, sinks=True)
    _assert_close(got, want)
    torch.testing.assert_close(k_got.cpu(), k_want, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 128), (4, 1, 256)])
def test_rope_attention_decode_large_heads(heads, kv_heads, d):
    """Head dims of the benchmark models (d = 256: 16-key tiles, 4-stage pipeline), writer in a late segment."""
    got, want, (k_got, _), (k_want, _) = _rope_attention_case("neox_partial_qk_norm_gemma", window=None, chunk=None,
                                                              segs=8, seed=d, heads=heads, kv_heads=kv_heads, d=d,
                                                              long=150)
    _assert_close(got, want)
    torch.testing.assert_close(k_got.cpu(), k_want, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_rope_attention_prefill_runs_both_ops():
    """A batch with a prefill takes the two-op path (its new keys are read by many programs)."""
    b = make_batch([3, 1], [5, 9], 2, 4, num_heads=2, num_kv_heads=1, head_dim=16)
    kc, vc = poison_unreferenced(b, b.cam)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(4, 2, 16, generator=g), torch.randn(4, 1, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    positions = torch.tensor([2, 3, 4, 8])
    kw = dict(prep=QKPrep(head_dim=16, rot_dim=16), inv_freq=rope_inv_freq(Rope(theta=10000.0), 16),
              q_norm_weight=None, k_norm_weight=None, scale=b.scale)
    got, want, (k_dev, _), (want_k, _) = _rope_attention_both(q, k, v, positions, kc, vc, b.cam.slot_mapping, b.cam,
                                                              kw)
    _assert_close(got, want)


def test_write_kv_matches_reference_and_skips_negative_slots():
    g = torch.Generator().manual_seed(0)
    nb, bs, h, d = 6, 3, 2, 16
    pool = torch.randn(nb, 2, bs, h, d, generator=g)
    ref_pool = pool.clone()
    slots = torch.tensor([7, 0, 17, -1, 4])
    k = torch.randn(5, h, d, generator=g)
    v = torch.randn(5, h, d, generator=g)
    keep = slots >= 0
    write_kv_ref(k[keep], v[keep], ref_pool[:, 0], ref_pool[:, 1], slots[keep])
    dev_pool = pool.to(DEVICE)
    ta.write_kv_triton(_to(k), _to(v), dev_pool[:, 0], dev_pool[:, 1], slots.to(DEVICE))
    assert torch.equal(dev_pool.cpu(), ref_pool)


def test_bad_inputs():
    b = make_batch([3, 1], [5, 9], 2, seed=2, head_dim=16)
    with pytest.raises(ValueError, match="sliding_window"):
        ta.paged_attention_triton(b.q, b.k_cache, b.v_cache, b.cam, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="tokens"):
        ta.paged_attention_triton(b.q[:2], b.k_cache, b.v_cache, b.cam, scale=1.0)


def test_backend_registry_entry():
    from hybridkv.backends.registry import _REGISTRY, get_backend

    assert _REGISTRY["triton"].factory is not None
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="CUDA"):
            get_backend("triton", "cpu")
    else:
        be = get_backend("triton", "cuda")
        assert be.name == "triton" and be.paged_attention is ta.paged_attention_triton


# ------------------------------------------------------------------------------------------ head dim 512

# launch_config's choice per (head_dim, group, max_query_len, elem_bytes): the tuned shapes up to d = 256 (pinned:
# they come from GPU sweeps) and the d = 512 ones (Gemma-4's global layers)
CONFIGS = [
    ((128, 4, 1, 2), (16, 4, 64, 4, 2)),
    ((128, 4, 64, 2), (64, 16, 64, 4, 2)),
    ((64, 8, 64, 2), (128, 16, 128, 4, 2)),
    ((256, 4, 1, 2), (16, 4, 16, 4, 4)),
    ((256, 4, 64, 2), (64, 16, 64, 8, 2)),       # a small step (<= SMALL_STEP_TOKENS)
    ((256, 4, 512, 2), (64, 16, 64, 8, 2)),
    ((256, 4, 513, 2), (128, 32, 64, 8, 2)),
    ((256, 4, 64, 4), (64, 16, 32, 8, 2)),
    ((512, 8, 1, 2), (16, 2, 16, 4, 4)),
    ((512, 8, 1, 4), (16, 2, 16, 4, 2)),
    ((512, 32, 1, 2), (32, 1, 16, 8, 4)),
    ((512, 8, 64, 2), (32, 4, 16, 8, 2)),
    ((512, 8, 64, 4), (16, 2, 16, 8, 2)),
    ((512, 1, 64, 2), (32, 32, 16, 8, 2)),
]


@pytest.mark.parametrize(("args", "want"), CONFIGS)
def test_launch_config_table(args, want):
    d, group, mql, elem = args
    cfg = ta.launch_config(head_dim=d, group=group, max_query_len=mql, elem_bytes=elem)
    assert (cfg["BLOCK_M"], cfg["BLOCK_Q"], cfg["TILE"], cfg["num_warps"], cfg["num_stages"]) == want


# graph_min_segments per (head_dim, kv heads, max_query_len, elem_bytes): 2 only for small steps with prompts at
# d = 256 with one KV head, bf16
@pytest.mark.parametrize(("d", "kvh", "mql", "elem", "want"), [
    (256, 1, 260, 2, 2), (256, 1, 512, 2, 2), (200, 1, 2, 2, 2),
    (256, 1, 1, 2, 1), (256, 1, 513, 2, 1), (256, 1, 260, 4, 1), (256, 4, 260, 2, 1), (128, 1, 260, 2, 1),
    (512, 1, 260, 2, 1),
])
def test_graph_min_segments(d: int, kvh: int, mql: int, elem: int, want: int) -> None:
    assert ta.graph_min_segments(head_dim=d, num_kv_heads=kvh, max_query_len=mql, elem_bytes=elem) == want


def test_long_step_shape_at_head_dim_256(monkeypatch):
    """The 128-row d = 256 prefill shape (queries longer than ``SMALL_STEP_TOKENS``), made to run at test size,
    against the reference and the oracle, with a window."""
    monkeypatch.setattr(ta, "SMALL_STEP_TOKENS", 1)
    assert ta.launch_config(head_dim=256, group=2, max_query_len=30)["BLOCK_M"] == 128
    b = make_batch([30, 1, 12], [30, 41, 20], 8, 11, num_heads=4, num_kv_heads=2, head_dim=256)
    kc, vc = poison_unreferenced(b, b.cam)
    ref = paged_attention_ref(b.q, kc, vc, b.cam, scale=b.scale, sliding_window=9)
    out = _run(_to(b.q), *_strided_pool(kc, vc), b.cam, scale=b.scale, sliding_window=9)
    _assert_close(out, ref)
    _assert_close(out, dense_attention(b, window=9))


@gpu
@pytest.mark.gpu
def test_gpu_captured_small_mixed_step_at_head_dim_256(monkeypatch):
    """A mixed step's layout (decodes, a prompt, empty request rows after them, as the mixed graphs' buffers hold)
    at d = 256 in bf16, captured in a CUDA graph: it splits (``graph_min_segments``) and its replay is within 2x
    of bf16 torch's error, with a sliding window and without."""
    monkeypatch.setattr(ta, "_num_sms", lambda index: 8)     # the step's 20 programs: no split of its own
    launches = []
    forms = ta._reduce_segments_kernel
    monkeypatch.setattr(ta, "_reduce_segments_kernel",
                        type("Spy", (), {"pick": lambda self, t: launches.append(t) or forms.pick(t)})())
    q_lens = [1] * 6 + [70] + [0] * 9
    s_lens = [90, 130, 40, 300, 7, 61] + [70] + [0] * 9
    b = make_batch(q_lens, s_lens, 16, 3, num_heads=4, num_kv_heads=1, head_dim=256)
    b = _rounded_to_bf16(b)
    kc, vc = poison_unreferenced(b, b.cam)
    k16, v16 = _strided_pool(kc.bfloat16(), vc.bfloat16())
    q, cam = _to(b.q, torch.bfloat16), _cam_to(b.cam)
    for window in (None, 50):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        run = functools.partial(ta.paged_attention_triton, q, k16, v16, cam, scale=b.scale, sliding_window=window,
                                out=out)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        launches.clear()
        with torch.cuda.stream(stream):
            run()                                       # the eager form (the graph's compiles at capture)
        torch.cuda.current_stream().wait_stream(stream)
        assert not launches, "the eager step split: the capture's minimum is not what is tested"
        graph = torch.cuda.CUDAGraph()
        launches.clear()
        with torch.cuda.graph(graph):
            run()
        assert launches, "the captured step did not split"
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref32 = dense_attention(b, window=window).to(DEVICE)
        err = (out.float() - ref32).norm() / ref32.norm()
        err_base = (_eager_bf16(b, window, None) - ref32).norm() / ref32.norm()
        assert not torch.isnan(out).any() and err <= 2 * err_base, (window, float(err), float(err_base))


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("d", [16, 24, 64, 128, 256, 320, 512])
def test_launch_config_fits_shared_memory(d, elem):
    """Every shape launch_config picks (decode and prefill, GQA groups 1-16) has a shared-memory bound within an
    H100 / H200 block's 227 KiB; the bound catches the fp32 d = 256 prefill shape that asked for 288 KiB."""
    for group in (1, 2, 3, 4, 5, 8, 16):
        for mql in (1, 2, 512, 513, 4096):
            cfg = ta.launch_config(head_dim=d, group=group, max_query_len=mql, elem_bytes=elem)
            assert cfg["BLOCK_Q"] * group <= cfg["BLOCK_M"]
            need = ta.shared_memory_bound(cfg, head_dim=d, elem_bytes=elem)
            assert need <= ta.SHARED_MEMORY_PER_BLOCK, (d, elem, group, mql, cfg, need)
    old_fp32 = {"BLOCK_M": 128, "BLOCK_Q": 32, "TILE": 64, "num_warps": 8, "num_stages": 2}
    assert ta.shared_memory_bound(old_fp32, head_dim=256, elem_bytes=4) > ta.SHARED_MEMORY_PER_BLOCK


# Gemma-4's global layers: one KV head of 512, GQA group 8 (unless said). (name, q_lens, s_lens, block_size,
# heads, window, softcap, sinks, num_segments); segments 64 > 32: the reduction loops in the graph form too
D512_CASES = [
    ("prefill_chunked_decode", [1, 9, 5], [23, 9, 17], 4, 8, None, None, False, 1),
    ("decode_split", [1, 1, 1], [5, 40, 18], 16, 8, None, None, False, 4),
    ("decode_split_64", [1, 1], [3, 37], 16, 8, None, None, False, 64),
    ("prefill_split", [12, 1], [20, 30], 8, 8, None, None, False, 2),
    ("window_softcap", [6, 1, 1], [14, 33, 7], 4, 8, 5, 20.0, False, 1),
    ("window_softcap_split", [1, 1, 4], [33, 7, 20], 4, 8, 9, 0.5, False, 4),
    ("sinks", [7, 1], [11, 25], 8, 8, None, None, True, 1),
    ("sinks_split_window", [1, 5, 1], [30, 12, 2], 8, 8, 6, None, True, 8),
    ("group_2", [9, 1], [9, 21], 8, 2, None, None, False, 1),
]


_D512_QUICK = ("prefill_chunked_decode", "decode_split_64", "sinks_split_window")   # the rest: slow tier


@pytest.mark.parametrize(
    ("name", "q_lens", "s_lens", "bs", "heads", "window", "softcap", "sinks", "segs", "graph_split"),
    [pytest.param(*c, g, id=f"{c[0]}-{g}", marks=() if c[0] in _D512_QUICK and not g else (pytest.mark.slow,))
     for c in D512_CASES for g in (False, True)])
def test_head_dim_512_matches_reference_and_oracle(name, q_lens, s_lens, bs, heads, window, softcap, sinks, segs,
                                                   graph_split, monkeypatch):
    """d = 512 through every path of the kernel (prefill, chunked prefill, decode, split-KV and the reduction in
    both forms, sinks, trimmed window, softcap) against the reference and the dense oracle; blocks no row
    references are NaN."""
    monkeypatch.setattr(ta, "capturing", lambda t: graph_split)
    seed = len(name)
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=heads, num_kv_heads=1, head_dim=512, extra_cols=1)
    sink_logits = _sinks(heads, seed) if sinks else None
    cam = trim_sliding_window(b.cam, window) if window is not None else b.cam
    kc, vc = poison_unreferenced(b, cam)
    want = dense_attention(b, window=window, softcap=softcap, sinks=sink_logits)
    ref = paged_attention_ref(b.q, kc, vc, cam, scale=b.scale, sliding_window=window, softcap=softcap,
                              sinks=sink_logits)
    _assert_close(ref, want)
    k, v = _strided_pool(kc, vc)
    out = _run(_to(b.q), k, v, cam, scale=b.scale, sliding_window=window, softcap=softcap,
               sinks=_to(sink_logits) if sinks else None, num_segments=segs)
    _assert_close(out, want)


@pytest.mark.parametrize("segs", [1, 8])
def test_rope_attention_decode_head_dim_512(segs):
    """The fused decode (Gemma q/k norm + proportional RoPE + KV write inside the attention kernel) at Gemma-4's
    global shape: 8 q heads on one KV head of 512."""
    got, want, (k_got, v_got), (k_want, v_want) = _rope_attention_case(
        "gemma4_global", window=None, chunk=None, segs=segs, seed=512 + segs, heads=8, kv_heads=1,
        d=512, long=37)
    _assert_close(got, want)
    torch.testing.assert_close(k_got.cpu(), k_want, equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_got.cpu(), v_want, equal_nan=True, atol=0, rtol=0)


def test_rope_attention_prefill_head_dim_512():
    """A batch with a prefill at d = 512: ``qk_rope_write_kv_triton`` then the paged kernel, output and cache."""
    d, heads = 512, 8
    b = make_batch([5, 1], [5, 12], 4, 5, num_heads=heads, num_kv_heads=1, head_dim=d)
    kc, vc = poison_unreferenced(b, b.cam)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(6, h, d, generator=g) for h in (heads, 1, 1))
    positions = torch.tensor([0, 1, 2, 3, 4, 11])
    prep_kw, rope = GEMMA4_GLOBAL_PREP
    prep = QKPrep(head_dim=d, eps=1e-6, **prep_kw)
    kw = dict(prep=prep, inv_freq=rope_inv_freq(rope, prep.rot_dim),
              q_norm_weight=torch.randn(d, generator=g) * 0.3 + 1, k_norm_weight=torch.randn(d, generator=g) * 0.3 + 1,
              scale=1.0)
    got, want, (k_dev, _), (want_k, _) = _rope_attention_both(q, k, v, positions, kc, vc, b.cam.slot_mapping, b.cam,
                                                              kw)
    _assert_close(got, want)
    torch.testing.assert_close(k_dev.cpu(), want_k, equal_nan=True, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ GPU only

def _eager_bf16(b, window, softcap, sinks=None) -> torch.Tensor:
    """Dense attention in eager torch with bf16 tensors: the low-precision torch baseline (``sinks``: HF
    gpt-oss's extra softmax column)."""
    outs = []
    qsl, seq = b.cam.query_start_loc_cpu, b.cam.seq_lens_cpu
    for r in range(b.cam.num_reqs):
        t0, t1, s = int(qsl[r]), int(qsl[r + 1]), int(seq[r])
        group = b.q.shape[1] // b.k_dense[r].shape[1]
        q = b.q[t0:t1].to(DEVICE, torch.bfloat16).transpose(0, 1)
        k = b.k_dense[r].to(DEVICE, torch.bfloat16).repeat_interleave(group, 1).transpose(0, 1)
        v = b.v_dense[r].to(DEVICE, torch.bfloat16).repeat_interleave(group, 1).transpose(0, 1)
        logits = (q @ k.transpose(1, 2)) * b.scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        p = torch.arange(s - (t1 - t0), s, device=DEVICE)[:, None]
        kk = torch.arange(s, device=DEVICE)[None, :]
        mask = kk <= p
        if window is not None:
            mask &= p - kk < window
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.to(DEVICE, torch.bfloat16)[:, None, None].expand(-1, t1 - t0, 1)
            probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(logits, -1)
        outs.append((probs @ v).transpose(0, 1))
    return torch.cat(outs).float()


def _rounded_to_bf16(b):
    """``b`` with its inputs rounded to bf16 once (kept in fp32): the fp32 reference and a bf16 run then see the same
    numbers."""
    return type(b)(cam=b.cam, q=b.q.bfloat16().float(), k_dense=[k.bfloat16().float() for k in b.k_dense],
                   v_dense=[v.bfloat16().float() for v in b.v_dense], k_cache=b.k_cache.bfloat16().float(),
                   v_cache=b.v_cache.bfloat16().float(), scale=b.scale)


def _check_bf16_within_2x_of_torch(b, window, softcap, sinks) -> None:
    """The kernel in bf16 against the fp32 dense oracle: no NaN (unreferenced blocks are NaN-poisoned), and an
    error at most 2x that of bf16 torch. The inputs are rounded to bf16 once: the fp32 reference and the baseline
    then see the same numbers."""
    b = _rounded_to_bf16(b)
    cam = trim_sliding_window(b.cam, window) if window is not None else b.cam
    kc, vc = poison_unreferenced(b, cam)
    k16, v16 = _strided_pool(kc.bfloat16(), vc.bfloat16())
    ref32 = dense_attention(b, window=window, softcap=softcap, sinks=sinks).to(DEVICE)
    ours = _run(_to(b.q, torch.bfloat16), k16, v16, cam, scale=b.scale, sliding_window=window, softcap=softcap,
                sinks=_to(sinks, torch.bfloat16) if sinks is not None else None)
    assert not torch.isnan(ours).any()
    err = (ours.float() - ref32).norm() / ref32.norm()
    err_base = (_eager_bf16(b, window, softcap, sinks) - ref32).norm() / ref32.norm()
    assert err <= 2 * err_base, (float(err), float(err_base))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_gpu_bf16_error_within_2x_of_bf16_torch(seed):
    """bf16 inputs: our error vs an fp32 reference is at most ~2x that of the same math in bf16 torch (with
    gpt-oss sinks on even seeds)."""
    rng = np.random.default_rng(100 + seed)
    q_lens, s_lens = _random_spec(rng, max_reqs=8, max_len=700)
    bs = int(rng.choice([1, 5, 16, 32]))
    window = None if seed % 2 else int(rng.integers(16, 300))
    softcap = 50.0 if seed % 3 == 0 else None
    sinks = _sinks(8, seed).bfloat16().float() if seed % 2 == 0 else None
    b = make_batch(q_lens, s_lens, bs, seed, num_heads=8, num_kv_heads=2, head_dim=128)
    _check_bf16_within_2x_of_torch(b, window, softcap, sinks)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_bf16_head_dim_512_error_within_2x_of_bf16_torch(seed):
    """Gemma-4's global shape in bf16 at GPU sizes (rows up to 1500 keys, prefills of a few hundred tokens,
    split decode): error vs fp32 at most ~2x that of bf16 torch; softcap / window / sinks on some seeds."""
    rng = np.random.default_rng(512 + seed)
    q_lens, s_lens = _random_spec(rng, max_reqs=6, max_len=1500)
    window = int(rng.integers(64, 600)) if seed % 2 else None
    softcap = 30.0 if seed == 1 else None
    sinks = _sinks(8, seed).bfloat16().float() if seed == 2 else None
    b = make_batch(q_lens, s_lens, 16, seed, num_heads=8, num_kv_heads=1, head_dim=512)
    _check_bf16_within_2x_of_torch(b, window, softcap, sinks)


def test_unsupported_head_dim_raises_explicitly_and_falls_back_under_auto(monkeypatch, caplog):
    """head_dim > 512: the explicit triton backend refuses with the constraint named; ``auto`` runs the
    torch reference for that call instead and logs it once."""
    import logging

    from hybridkv.backends import registry
    from hybridkv.backends.registry import UnsupportedConfig, get_backend

    b = make_batch([3, 1], [5, 9], 4, 0, num_heads=2, num_kv_heads=1, head_dim=640)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale)
    with pytest.raises(UnsupportedConfig, match=r"head_dim 640 > 512"):
        ta.paged_attention_triton(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale)
    monkeypatch.setattr(registry, "_FALLBACKS_LOGGED", set())
    be = get_backend("auto", "cuda")        # built for CUDA; the fallback decision does not need a GPU
    with caplog.at_level(logging.WARNING, logger="hybridkv.backends"):
        for _ in range(2):
            out = be.paged_attention(b.q, b.k_cache, b.v_cache, b.cam, scale=b.scale)
            torch.testing.assert_close(out, ref)
    lines = [r.getMessage() for r in caplog.records if "falls back to torch" in r.getMessage()]
    assert len(lines) == 1 and "head_dim 640" in lines[0]


@pytest.mark.parametrize(("programs", "max_seq_len", "tile", "want", "case"), [
    (8, 160, 64, 1, "gpt-oss sliding-128 decode row in a graph (3 tiles): one program per kv head, no reduction"),
    (8, 128, 64, 1, "two tiles"),
    (8, 256, 64, 2, "four tiles: two segments of two"),
    (8, 320, 64, 2, "five tiles: segments of at least two"),
    (8, 384, 64, 4, "six tiles: the next power of two of half of them"),
    (8, 131072, 64, 64, "long rows: >= 2 programs per SM (132 SMs)"),
    (1, 1 << 20, 16, 128, "capped at _MAX_SEGMENTS"),
    (132, 131072, 64, 1, "as many programs as SMs: no split"),
])
def test_split_segments(programs: int, max_seq_len: int, tile: int, want: int, case: str) -> None:
    assert ta.split_segments(programs=programs, sms=132, max_seq_len=max_seq_len, tile=tile) == want, case


@triton.jit
def _find_request_kernel(out_ptr, qsl_ptr, num_reqs, BLOCK_Q: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, find_request(qsl_ptr, num_reqs, pid, BLOCK_Q))


@pytest.mark.parametrize(("q_lens", "block_q", "case"), [
    ([5], 4, "one request"),
    ([1] * 40 + [260, 27] + [0] * 215, 32, "a mixed graph's layout: decodes, a prompt, the padding request"),
    ([0, 3, 0, 0, 17, 1] * 50, 8, "empty requests between the others, 300 requests"),
    ([129] + [1] * 127 + [0] * 2, 16, "the answer at a 128-request boundary"),
])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_find_request_matches_brute_force(q_lens: list[int], block_q: int, case: str, dtype: type) -> None:
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(dtype)
    key = qsl[:-1] // block_q + np.arange(len(q_lens))
    grid = int(qsl[-1]) // block_q + len(q_lens)
    out = torch.full((grid,), -7, dtype=torch.int32, device=DEVICE)
    _find_request_kernel[(grid,)](out, torch.from_numpy(qsl).to(DEVICE), len(q_lens), BLOCK_Q=block_q)
    want = np.searchsorted(key, np.arange(grid), side="right") - 1
    np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=case)

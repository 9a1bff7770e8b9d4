"""Vendor kernel backends (flash-attn, mamba-ssm, causal-conv1d): selection rules and adapters.

CPU part (always runs): fake vendor modules injected into ``sys.modules`` implement the upstream calls'
documented semantics (batch rows, per-row initial states, bottom-right causal alignment, ``seq_idx``,
``state_batch_indices`` ...) independently of our references. Through them the adapters' argument mapping
is checked against the ``*_ref`` ops on random packed batches, and the registry's rules: explicit choice,
clear errors, fallback only under ``auto`` with one log line per reason.

GPU part: the real packages against the references; skipped without CUDA or without the package.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import logging
import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridkv.backends import registry
from hybridkv.backends import vendor_flash_attn as vfa
from hybridkv.backends import vendor_mamba as vm
from hybridkv.backends.registry import UnsupportedConfig, get_backend
from hybridkv.layers.ops import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    paged_attention_ref,
    selective_state_update_mamba1_ref,
    ssd_chunk_scan_ref,
    ssd_state_update_ref,
)
from hybridkv.layers.ops.fused_ref import QKPrep
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import make_local_attention_virtual_batches, trim_sliding_window

_HAS_CUDA = torch.cuda.is_available()


# ============================================================================ fake vendor packages


def _silu_if(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation in ("silu", "swish") else y


def _softplus20(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d <= 20.0, torch.log1p(torch.exp(d)), d)


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2 semantics with a paged cache: lengths from cu_seqlens_k, bottom-right aligned masks."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
    assert block_table.stride(-1) == 1 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert dropout_p == 0.0 and alibi_slopes is None
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cq[0] == ck[0] == 0 and cq[-1] == q.shape[0]
    _, bs, hk, d = k.shape
    group = q.shape[1] // hk
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(len(cq) - 1):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert sq <= max_seqlen_q and sk <= max_seqlen_k
        if sq == 0:
            continue
        blocks = block_table[b, : -(-sk // bs)].long()  # only the pages the length covers
        kk = k[blocks].reshape(-1, hk, d)[:sk].float().repeat_interleave(group, 1)
        vv = v[blocks].reshape(-1, hk, d)[:sk].float().repeat_interleave(group, 1)
        s = torch.einsum("nhd,khd->hnk", q[cq[b]:cq[b + 1]].float(), kk) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        vis = torch.ones(sq, sk, dtype=torch.bool)
        if right >= 0:
            vis &= j <= i + right
        if left >= 0:
            vis &= j >= i - left
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)  # empty row -> 0
        out[cq[b]:cq[b + 1]] = torch.einsum("hnk,khd->nhd", p, vv)
    return out.to(q.dtype)


def fake_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                   return_final_states=False, return_varlen_states=False):
    """mamba-ssm semantics per batch row, as a plain sequential recurrence (one initial state per row)."""
    assert seq_idx is None and not return_varlen_states
    batch, length, h, p = x.shape
    assert dt.shape == (batch, length, h) and A.shape == (h,) and B.shape == C.shape
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    d = (_softplus20(d) if dt_softplus else d).clamp(dt_limit[0], dt_limit[1])
    Bh = B.float().repeat_interleave(h // B.shape[2], 2)
    Ch = C.float().repeat_interleave(h // C.shape[2], 2)
    state = (initial_states.float().clone() if initial_states is not None
             else torch.zeros(batch, h, p, B.shape[-1]))
    y = torch.zeros(batch, length, h, p)
    for t in range(length):
        dA = torch.exp(d[:, t] * A.float())  # (batch, h)
        state = dA[..., None, None] * state + (d[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        y[:, t] = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
    if D is not None:
        y = y + (D.float()[:, None] if D.dim() == 1 else D.float()) * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return (y.to(x.dtype), state) if return_final_states else y.to(x.dtype)


def fake_selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                state_batch_indices=None):
    """mamba-ssm semantics (heads or not), updating ``state`` in place at ``state_batch_indices``."""
    assert D is not None and dt_bias is not None, "upstream's wrapper fails on D / dt_bias None"
    has_heads = state.dim() > 3
    sv = state if has_heads else state.unsqueeze(1)
    x3, dt3, z3 = (t if t is None or t.dim() == 3 else t.unsqueeze(1) for t in (x, dt, z))
    A3 = A if A.dim() == 3 else A.unsqueeze(0)
    B3, C3 = (t if t.dim() == 3 else t.unsqueeze(1) for t in (B, C))
    D2, bias2 = (t if t.dim() == 2 else t.unsqueeze(0) for t in (D, dt_bias))
    batch, heads, dim = x3.shape
    assert dt3.shape == x3.shape and A3.shape == (heads, dim, sv.shape[-1]) and D2.shape == bias2.shape == (heads, dim)
    idx = state_batch_indices.long() if state_batch_indices is not None else torch.arange(batch)
    d = dt3.float() + bias2.float()
    if dt_softplus:
        d = _softplus20(d)
    s = sv[idx].float()
    Bh = B3.float().repeat_interleave(heads // B3.shape[1], 1)
    Ch = C3.float().repeat_interleave(heads // C3.shape[1], 1)
    s = s * torch.exp(A3.float()[None] * d[..., None]) + (d * x3.float())[..., None] * Bh[:, :, None, :]
    sv[idx] = s.to(state.dtype)
    out = torch.einsum("bhdn,bhn->bhd", s, Ch) + x3.float() * D2.float()
    if z3 is not None:
        out = out * F.silu(z3.float())
    out = out.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    """causal-conv1d semantics with ``seq_idx``: taps from another sequence (or before the row) read 0."""
    batch, dim, length = x.shape
    assert x.stride(1) == 1 and dim % 8 == 0, "seq_idx needs the channel-last layout"
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == (batch, length)
    assert initial_states is None and not return_final_states
    width = weight.shape[1]
    out = torch.zeros(batch, dim, length)
    for k in range(width):  # tap k reads input t - (width - 1 - k)
        shift = width - 1 - k
        src = F.pad(x.float(), (shift, 0))[..., :length]
        same = F.pad(seq_idx, (shift, 0), value=-1)[..., :length] == seq_idx
        out += weight[:, k].float()[None, :, None] * src * same[:, None, :]
    if bias is not None:
        out += bias.float()[None, :, None]
    return _silu_if(out, activation).to(x.dtype)


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                              conv_state_indices=None):
    assert conv_state_indices.dtype == torch.int32 and conv_state.dtype == x.dtype and cache_seqlens is None
    idx = conv_state_indices.long()
    width, state_len = weight.shape[1], conv_state.shape[-1]
    full = torch.cat([conv_state[idx].float(), x.float()[..., None]], -1)  # (batch, dim, state_len + 1)
    y = (full[..., -width:] * weight.float()).sum(-1) + (bias.float() if bias is not None else 0.0)
    conv_state[idx] = full[..., -state_len:].to(conv_state.dtype)
    return _silu_if(y, activation).to(x.dtype)


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def install_fakes(monkeypatch, *, flash: bool = True, mamba: bool = True, flash_fn=fake_flash_attn_varlen_func):
    if flash:
        attrs = {} if flash_fn is None else {"flash_attn_varlen_func": flash_fn}
        monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn", **attrs))
    if mamba:
        for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
            monkeypatch.setitem(sys.modules, name, _module(name))
        monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", _module(
            "mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=fake_mamba_chunk_scan_combined))
        monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.selective_state_update", _module(
            "mamba_ssm.ops.triton.selective_state_update", selective_state_update=fake_selective_state_update))
        monkeypatch.setitem(sys.modules, "causal_conv1d", _module(
            "causal_conv1d", causal_conv1d_fn=fake_causal_conv1d_fn, causal_conv1d_update=fake_causal_conv1d_update))


@pytest.fixture
def cpu_vendor_ops(monkeypatch):
    """Adapters built on the fakes, with the CUDA-device check lifted so they run on CPU tensors."""
    install_fakes(monkeypatch)
    monkeypatch.setattr(vm, "_device_reason", lambda *t: None)
    monkeypatch.setattr(vfa, "_device_reason", lambda q: None)
    return {**vm.mamba_ssm_ops(), **vfa.flash_attn_ops()}


# ============================================================================ random batches


def _make_attention_batch(q_lens, s_lens, bs, seed, *, heads, kv_heads, d, dtype, device="cpu"):
    """CAM + a cache whose every block no request references (and every unwritten slot) holds NaN."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // bs) for s in s_lens]
    ids = rng.permutation(np.arange(1, sum(need) + 3))
    bt = np.zeros((len(s_lens), max(need) + 1), np.int64)
    off = 0
    for r, k in enumerate(need):
        bt[r, :k] = ids[off:off + k]
        off += k
    num_blocks = sum(need) + 3
    cam = CommonAttentionMetadata.build(query_lens=q_lens, seq_lens=s_lens, block_table=bt, block_size=bs)
    kc = torch.full((num_blocks, bs, kv_heads, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    for r, s in enumerate(s_lens):
        pos = np.arange(s)
        slots = torch.from_numpy(bt[r, pos // bs] * bs + pos % bs)
        kc.view(-1, kv_heads, d)[slots] = torch.randn(s, kv_heads, d, generator=g)
        vc.view(-1, kv_heads, d)[slots] = torch.randn(s, kv_heads, d, generator=g)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    pool = torch.stack([kc, vc], 1).to(device=device, dtype=dtype)  # the engine's (blocks, 2, bs, h, d) pool
    return cam, q.to(device=device, dtype=dtype), pool[:, 0], pool[:, 1], d**-0.5


def _poison_unreferenced(k, v, cam):
    nblk = -(-cam.seq_lens_cpu // cam.block_size)
    keep = {int(b) for r in range(cam.num_reqs) for b in cam.block_table_cpu[r, :nblk[r]]}
    dead = torch.tensor([b for b in range(k.shape[0]) if b not in keep], dtype=torch.long)
    k, v = k.clone(), v.clone()
    k[dead.to(k.device)] = float("nan")
    v[dead.to(v.device)] = float("nan")
    return k, v


def _cam_to(cam: CommonAttentionMetadata, device: str) -> CommonAttentionMetadata:
    if device == "cpu":
        return cam
    return cam.replace(query_start_loc=cam.query_start_loc.to(device), seq_lens=cam.seq_lens.to(device),
                       key_start=cam.key_start.to(device), block_table_tensor=cam.block_table_tensor.to(device),
                       slot_mapping=cam.slot_mapping.to(device))


def _packed(seed: int, *, max_reqs: int = 4, max_len: int = 19, single: bool = False):
    """(lens, slots, has_init, num_slots): new requests, continuations, 0/1-token ones, shuffled spare slots."""
    rng = np.random.default_rng(seed)
    n = 1 if single else int(rng.integers(1, max_reqs + 1))
    lens = [int(x) for x in rng.choice([0, 1, 2, 3, 5, 8, 13, max_len], size=n)]
    num_slots = n + int(rng.integers(0, 3))
    slots = [int(s) for s in rng.permutation(num_slots)[:n]]
    has_init = [bool(b) for b in rng.integers(0, 2, size=n)]
    return lens, slots, has_init, num_slots


def _meta(lens, slots, has_init, device="cpu"):
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=device)
    return qsl, torch.tensor(slots, device=device), torch.tensor(has_init, device=device)


def _fresh_pool(shape, has_init, slots, dtype, g, device="cpu"):
    """A state pool whose fresh slots (no initial state) hold NaN garbage that must never be read."""
    pool = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    for s, init in zip(slots, has_init, strict=True):
        if not init:
            pool[s] = float("nan")
    return pool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().nan_to_num(0.0), b.float().nan_to_num(0.0)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _assert_pools(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert torch.equal(actual.isnan(), expected.isnan()), "a slot the batch does not own was touched"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol, equal_nan=True)


# ============================================================================ registry rules (CPU)


def test_auto_on_cpu_is_torch():
    assert get_backend("auto", "cpu").name == "torch"


@pytest.mark.parametrize(("name", "package"), [("flash_attn", "flash_attn"), ("mamba_ssm", "mamba_ssm")])
def test_missing_vendor_package_is_a_clear_error(name, package):
    if registry._importable(package):
        pytest.skip(f"{package} is installed here")
    with pytest.raises(RuntimeError, match=f"{name}.*needs the package"):
        get_backend(name, "cuda")


def test_vendor_backend_needs_cuda(monkeypatch):
    install_fakes(monkeypatch)
    with pytest.raises(RuntimeError, match="CUDA"):
        get_backend("mamba_ssm", "cpu")


def test_explicit_vendor_backends_derive_from_triton(monkeypatch, caplog):
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch)
    triton = get_backend("triton", "cuda")
    with caplog.at_level(logging.INFO, logger="hybridkv.backends"):
        fa = get_backend("flash_attn", "cuda")
        ms = get_backend("mamba_ssm", "cuda")
    assert fa.name == "flash_attn" and ms.name == "mamba_ssm"
    assert fa.paged_attention.__module__ == vfa.__name__
    for op in ("write_kv", "causal_conv1d", "ssd_chunk_scan", "selective_scan"):
        assert getattr(fa, op) is getattr(triton, op)
    for op in ("causal_conv1d", "causal_conv1d_update", "ssd_chunk_scan", "ssd_state_update",
               "selective_state_update"):
        assert getattr(ms, op).__module__ == vm.__name__, op
    for op in ("paged_attention", "write_kv", "selective_scan", "rope_attention"):
        assert getattr(ms, op) is getattr(triton, op)
    # flash_attn replaced paged_attention: its decode batches must not take triton's fused attention kernel
    assert fa.rope_attention is not triton.rope_attention
    assert "kernel backend: mamba_ssm (requested" in caplog.text


def test_explicit_vendor_op_raises_unsupported_config(monkeypatch):
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch)
    be = get_backend("flash_attn", "cuda")
    cam, q, k, v, scale = _make_attention_batch([3, 1], [5, 9], 16, 0, heads=2, kv_heads=1, d=16,
                                                dtype=torch.bfloat16)
    with pytest.raises(UnsupportedConfig, match=r"block size 16 is not a multiple of 256.*backend='auto'"):
        be.paged_attention(q, k, v, cam, scale=scale)


@pytest.mark.skipif(_HAS_CUDA, reason="triton's RoPE op runs on CPU tensors: the interpreter (CPU machines)")
def test_explicit_flash_attn_decode_batches_use_its_attention(monkeypatch):
    """rope_attention of an explicit flash_attn backend is triton's RoPE + KV write, then flash's attention
    (here refusing block size 16), never triton's fused decode kernel."""
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch)
    be = get_backend("flash_attn", "cuda")
    cam, q, k_cache, v_cache, scale = _make_attention_batch([1, 1], [5, 9], 16, 0, heads=2, kv_heads=1, d=16,
                                                            dtype=torch.float32)
    k = torch.randn(2, 1, 16)
    with pytest.raises(UnsupportedConfig, match="block size 16"):
        be.rope_attention(q, k, k.clone(), torch.tensor([4, 8]), prep=QKPrep(head_dim=16), inv_freq=None,
                          q_norm_weight=None, k_norm_weight=None, k_cache=k_cache, v_cache=v_cache,
                          slot_mapping=cam.slot_mapping, cam=cam, scale=scale)


@pytest.mark.skipif(_HAS_CUDA, reason="the fallback runs triton on CPU tensors: the interpreter (CPU machines)")
def test_auto_composes_vendor_ops_and_falls_back_with_one_log(monkeypatch, caplog):
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch)
    monkeypatch.setattr(registry, "_FALLBACKS_LOGGED", set())
    triton = get_backend("triton", "cuda")
    with caplog.at_level(logging.INFO, logger="hybridkv.backends"):
        be = get_backend("auto", "cuda")
    # flash-attn's paged attention measured slower than ours (docs/performance.md): auto leaves it out
    assert be.name == "triton+mamba_ssm"
    assert "not using flash_attn (none of its ops measured faster than triton's)" in caplog.text
    assert be.paged_attention.__wrapped__ is triton.paged_attention
    # the composition and fallback rules, for a vendor attention op that auto would take
    monkeypatch.setitem(registry._AUTO_OPS, "flash_attn", frozenset({"paged_attention"}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridkv.backends"):
        be = get_backend("auto", "cuda")
    assert be.name == "triton+flash_attn+mamba_ssm"
    assert "kernel backend: triton+flash_attn+mamba_ssm (auto" in caplog.text
    assert be.paged_attention.__wrapped__.__module__ == vfa.__name__
    assert be.selective_scan is triton.selective_scan   # not replaced, not wrapped
    for op in ("causal_conv1d", "causal_conv1d_update", "ssd_chunk_scan", "ssd_state_update"):
        assert getattr(be, op) is getattr(triton, op), op   # triton's own kernels are faster: kept
    assert be.selective_state_update.__wrapped__.__module__ == vm.__name__
    assert be.rope_attention.__wrapped__ is triton.rope_attention    # decode batches: the fused triton kernel

    cam, q, k, v, scale = _make_attention_batch([3, 1, 4], [5, 9, 4], 4, 1, heads=4, kv_heads=2, d=16,
                                                dtype=torch.float32)
    ref = paged_attention_ref(q, k, v, cam, scale=scale, sliding_window=3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridkv.backends"):
        for _ in range(2):       # block size 4 (and fp32, and CPU): triton runs it; logged once
            out = be.paged_attention(q, k, v, cam, scale=scale, sliding_window=3)
            torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    lines = [r.getMessage() for r in caplog.records if "falls back to triton" in r.getMessage()]
    assert len(lines) == 1 and "flash_attn paged_attention" in lines[0] and "256" in lines[0]


@pytest.mark.skipif(_HAS_CUDA, reason="the fallback runs on CPU tensors (CPU machines)")
def test_auto_fallback_of_a_state_op_leaves_no_partial_update(monkeypatch):
    """The vendor op refuses (CPU tensors) before touching the pool; the fallback does the whole update."""
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch, flash=False)
    be = get_backend("auto", "cuda")
    assert be.name == "triton+mamba_ssm"
    g = torch.Generator().manual_seed(3)
    d, n = 6, 4
    x, dt = torch.randn(2, d, generator=g), torch.randn(2, d, generator=g)
    A, B, C = -torch.rand(d, n, generator=g), torch.randn(2, n, generator=g), torch.randn(2, n, generator=g)
    pool = torch.randn(4, d, n, generator=g)
    idx = torch.tensor([3, 0])
    ref_pool = pool.clone()
    ref = selective_state_update_mamba1_ref(ref_pool, x, dt, A, B, C, state_indices=idx)
    out = be.selective_state_update(pool, x, dt, A, B, C, state_indices=idx)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool, ref_pool, atol=1e-4, rtol=1e-4)


def test_broken_vendor_install(monkeypatch, caplog):
    """Installed but not importable (no compiled extension, API too old): explicit = error, auto = skipped."""
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fakes(monkeypatch, flash_fn=None)                            # flash_attn without the function
    with pytest.raises(RuntimeError, match="flash_attn.*does not import"):
        get_backend("flash_attn", "cuda")
    monkeypatch.setitem(registry._AUTO_OPS, "flash_attn", frozenset({"paged_attention"}))   # an op auto would take
    with caplog.at_level(logging.WARNING, logger="hybridkv.backends"):
        assert get_backend("auto", "cuda").name == "triton+mamba_ssm"
    assert "not using flash_attn: its package is installed but does not import" in caplog.text

    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                   softmax_scale=None, causal=False):
        raise AssertionError("never called")

    install_fakes(monkeypatch, mamba=False, flash_fn=old_varlen)
    with pytest.raises(RuntimeError, match="block_table"):
        get_backend("flash_attn", "cuda")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend("cudnn", "cuda")


# ============================================================================ flash-attn mapping (CPU, fakes)


# (q_lens, s_lens, block_size, heads, kv_heads, window, softcap, transform)
_FA_CASES = [
    ([1, 7, 300, 1], [9, 7, 300, 520], 256, 4, 2, None, None, None),
    ([5, 1, 12], [40, 33, 12], 4, 4, 1, 6, None, "trim"),
    ([3, 12, 1, 20], [19, 21, 9, 20], 4, 6, 2, None, 30.0, "local"),
    ([2, 1, 9], [17, 30, 9], 8, 2, 2, 5, 0.5, None),
]


@pytest.mark.parametrize(("q_lens", "s_lens", "bs", "heads", "kv_heads", "window", "softcap", "transform"),
                         _FA_CASES)
def test_flash_attn_mapping_matches_reference(cpu_vendor_ops, monkeypatch, q_lens, s_lens, bs, heads, kv_heads,
                                              window, softcap, transform):
    """Trimmed sliding-window tables and local-attention virtual batches included: key_start-relative
    positions are exactly FA2's bottom-right alignment. Unreferenced blocks are NaN."""
    monkeypatch.setattr(vfa, "PAGE_MULTIPLE", 1)         # the fake takes any page size
    cam, q, k, v, scale = _make_attention_batch(q_lens, s_lens, bs, 5, heads=heads, kv_heads=kv_heads, d=16,
                                                dtype=torch.bfloat16)
    if transform == "trim":
        cam = trim_sliding_window(cam, window)
    elif transform == "local":
        cam = make_local_attention_virtual_batches(cam, 8)
    k, v = _poison_unreferenced(k, v, cam)
    ref = paged_attention_ref(q, k, v, cam, scale=scale, sliding_window=window, softcap=softcap)
    out = cpu_vendor_ops["paged_attention"](q, k, v, cam, scale=scale, sliding_window=window, softcap=softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_flash_attn_arguments():
    cam = CommonAttentionMetadata.build(query_lens=[2, 0, 3], seq_lens=[600, 0, 3],
                                        block_table=[[3, 4, 5], [0, 0, 0], [1, 0, 0]], block_size=256,
                                        causal=False)
    q = torch.zeros(5, 4, 8, dtype=torch.bfloat16)
    args, kw = vfa.varlen_arguments(q, cam, scale=0.5, sliding_window=100, softcap=None)
    qsl, cu_k, max_q, max_k = args
    assert qsl.tolist() == [0, 2, 2, 5] and cu_k.tolist() == [0, 600, 600, 603] and cu_k.dtype == torch.int32
    assert (max_q, max_k) == (3, 600)
    assert kw["window_size"] == (99, -1) and kw["causal"] is False and "softcap" not in kw
    assert kw["block_table"].dtype == torch.int32 and kw["softmax_scale"] == 0.5
    causal = cam.replace(causal=True)
    assert vfa.varlen_arguments(q, causal, scale=1.0, sliding_window=1, softcap=2.0)[1]["window_size"] == (0, 0)
    assert vfa.varlen_arguments(q, causal, scale=1.0, sliding_window=None, softcap=2.0)[1]["softcap"] == 2.0


def test_flash_attn_constraints(cpu_vendor_ops):
    op = cpu_vendor_ops["paged_attention"]
    cam, q, k, v, scale = _make_attention_batch([1, 3], [300, 3], 256, 0, heads=2, kv_heads=1, d=16,
                                                dtype=torch.bfloat16)
    op(q, k, v, cam, scale=scale)                                              # fits
    with pytest.raises(UnsupportedConfig, match="dtype torch.float32"):
        op(q.float(), k.float(), v.float(), cam, scale=scale)
    with pytest.raises(UnsupportedConfig, match="KV cache dtype"):
        op(q, k.half(), v.half(), cam, scale=scale)
    cam12, q12, k12, v12, _ = _make_attention_batch([1], [3], 256, 0, heads=2, kv_heads=1, d=12,
                                                    dtype=torch.bfloat16)
    with pytest.raises(UnsupportedConfig, match="head_dim 12"):
        op(q12, k12, v12, cam12, scale=1.0)
    with pytest.raises(ValueError, match="tokens"):
        op(q[:2], k, v, cam, scale=scale)


def test_flash_attn_refuses_sinks_and_auto_falls_back(cpu_vendor_ops, monkeypatch):
    """flash-attn 2 has no attention sinks: the explicit backend refuses a gpt-oss layer's call naming why,
    before anything runs; under ``auto`` (were it to take the op) the call runs on the op it replaced."""
    from hybridkv.backends.registry import _with_fallback

    op = cpu_vendor_ops["paged_attention"]
    cam, q, k, v, scale = _make_attention_batch([1, 3], [300, 3], 256, 0, heads=2, kv_heads=1, d=16,
                                                dtype=torch.bfloat16)
    sinks = torch.tensor([1.5, -2.0])
    with pytest.raises(UnsupportedConfig, match="flash_attn.*attention sinks"):
        op(q, k, v, cam, scale=scale, sinks=sinks)
    monkeypatch.setattr(registry, "_FALLBACKS_LOGGED", set())
    fallback = _with_fallback(op, paged_attention_ref, fallback="torch")
    torch.testing.assert_close(fallback(q, k, v, cam, scale=scale, sinks=sinks),
                               paged_attention_ref(q, k, v, cam, scale=scale, sinks=sinks))


def test_flash_attn_needs_cuda_tensors(monkeypatch):
    install_fakes(monkeypatch, mamba=False)
    op = vfa.flash_attn_ops()["paged_attention"]
    cam, q, k, v, scale = _make_attention_batch([1], [300], 256, 0, heads=2, kv_heads=1, d=16, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedConfig, match="CUDA"):
        op(q, k, v, cam, scale=scale)


# ============================================================================ mamba mapping (CPU, fakes)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_matches_reference(cpu_vendor_ops, seed, width):
    lens, slots, has_init, num_slots = _packed(seed)
    dim = 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=g)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pool = _fresh_pool((num_slots, dim, width - 1), has_init, slots, torch.float32, g)
    qsl, idx, init = _meta(lens, slots, has_init)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, conv_states=ref_pool, query_start_loc=qsl, state_indices=idx,
                            has_initial_state=init)
    out = cpu_vendor_ops["causal_conv1d"](x, weight, bias, conv_states=pool, query_start_loc=qsl,
                                          state_indices=idx, has_initial_state=init)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    _assert_pools(pool, ref_pool, 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_causal_conv1d_update_matches_reference(cpu_vendor_ops, seed):
    g = torch.Generator().manual_seed(seed)
    batch, dim, width, num_slots = 3, 16, 4, 5
    x = torch.randn(batch, dim, generator=g)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pool = torch.randn(num_slots, dim, width - 1, generator=g)
    idx = torch.randperm(num_slots, generator=g)[:batch]
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, conv_states=ref_pool, weight=weight, bias=bias, state_indices=idx)
    out = cpu_vendor_ops["causal_conv1d_update"](x, conv_states=pool, weight=weight, bias=bias,
                                                 state_indices=idx, activation="silu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool)


def test_causal_conv1d_constraints_refuse_before_touching_state(cpu_vendor_ops):
    x, pool = torch.randn(3, 12), torch.randn(2, 12, 3)
    qsl, idx, init = _meta([3], [1], [True])
    before = pool.clone()
    with pytest.raises(UnsupportedConfig, match="multiple of 8"):
        cpu_vendor_ops["causal_conv1d"](x, torch.randn(12, 4), None, conv_states=pool, query_start_loc=qsl,
                                        state_indices=idx, has_initial_state=init)
    with pytest.raises(UnsupportedConfig, match="width 5"):
        cpu_vendor_ops["causal_conv1d"](torch.randn(3, 16), torch.randn(16, 5), None,
                                        conv_states=torch.randn(2, 16, 4), query_start_loc=qsl,
                                        state_indices=idx, has_initial_state=init)
    with pytest.raises(UnsupportedConfig, match="conv state dtype"):
        cpu_vendor_ops["causal_conv1d_update"](torch.randn(1, 12), conv_states=pool.double(),
                                               weight=torch.randn(12, 4), bias=None, state_indices=idx)
    assert torch.equal(pool, before)


def _ssd_inputs(lens, seed, *, nheads=4, headdim=4, ngroups=2, dstate=8, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    A = (-torch.rand(nheads, generator=g) * 2 - 0.1).to(device)
    return dict(x=r(t, nheads, headdim), dt=r(t, nheads) - 1.0, A=A, B=r(t, ngroups, dstate), C=r(t, ngroups, dstate),
                D=torch.randn(nheads, generator=g).to(device), dt_bias=torch.randn(nheads, generator=g).to(device),
                z=r(t, nheads, headdim))


@pytest.mark.parametrize("seed", range(10))
def test_ssd_chunk_scan_matches_reference(cpu_vendor_ops, seed):
    """One request (the packed row itself) and several (right-padded rows with dt = 0)."""
    lens, slots, has_init, num_slots = _packed(seed, single=seed < 3)
    kw = _ssd_inputs(lens, seed)
    if seed % 2:
        kw.pop("z")
    if seed % 3 == 0:
        kw["D"] = torch.randn(4, 4)                                          # (nheads, headdim)
    limit = (0.0, math.inf) if seed % 4 else (0.05, 0.8)
    g = torch.Generator().manual_seed(seed + 100)
    pool = _fresh_pool((num_slots, 4, 4, 8), has_init, slots, torch.float32, g)
    qsl, idx, init = _meta(lens, slots, has_init)
    ref_pool = pool.clone()
    ref = ssd_chunk_scan_ref(**kw, chunk_size=4, query_start_loc=qsl, ssm_states=ref_pool, state_indices=idx,
                             has_initial_state=init, dt_limit=limit)
    out = cpu_vendor_ops["ssd_chunk_scan"](**kw, chunk_size=4, query_start_loc=qsl, ssm_states=pool,
                                           state_indices=idx, has_initial_state=init, dt_limit=limit)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    _assert_pools(pool, ref_pool, 1e-4)


@pytest.mark.parametrize("variant", ["default", "limit", "no_bias_no_D", "D2d_z"])
def test_ssd_state_update_matches_reference(cpu_vendor_ops, variant):
    kw = _ssd_inputs([1, 1, 1], 7)
    kw.pop("z")
    if variant == "limit":
        kw["dt_limit"] = (0.05, 0.5)
    elif variant == "no_bias_no_D":
        kw.pop("dt_bias")
        kw.pop("D")
    elif variant == "D2d_z":
        kw["D"] = torch.randn(4, 4)
        kw["z"] = torch.randn(3, 4, 4)
    pool = torch.randn(5, 4, 4, 8)
    idx = torch.tensor([4, 0, 2])
    ref_pool = pool.clone()
    x, dt, A, B, C = (kw.pop(k) for k in ("x", "dt", "A", "B", "C"))
    ref = ssd_state_update_ref(ref_pool, x, dt, A, B, C, state_indices=idx, **kw)
    out = cpu_vendor_ops["ssd_state_update"](pool, x, dt, A, B, C, state_indices=idx, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_optional", [True, False])
def test_mamba1_state_update_matches_reference(cpu_vendor_ops, with_optional):
    g = torch.Generator().manual_seed(11)
    batch, dim, dstate = 3, 6, 4
    x, dt = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    A = -torch.rand(dim, dstate, generator=g)
    B, C = torch.randn(batch, dstate, generator=g), torch.randn(batch, dstate, generator=g)
    opt = dict(D=torch.randn(dim, generator=g), z=torch.randn(batch, dim, generator=g),
               dt_bias=torch.randn(dim, generator=g)) if with_optional else {}
    pool = torch.randn(4, dim, dstate, generator=g)
    idx = torch.tensor([1, 3, 0])
    ref_pool = pool.clone()
    ref = selective_state_update_mamba1_ref(ref_pool, x, dt, A, B, C, state_indices=idx, **opt)
    out = cpu_vendor_ops["selective_state_update"](pool, x, dt, A, B, C, state_indices=idx, **opt)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)


def test_vendor_signatures_match_the_references(cpu_vendor_ops):
    """Same parameter names and kinds as the ``*_ref`` twins (the layers call them by keyword)."""
    refs = {"paged_attention": paged_attention_ref, "causal_conv1d": causal_conv1d_ref,
            "causal_conv1d_update": causal_conv1d_update_ref, "ssd_chunk_scan": ssd_chunk_scan_ref,
            "ssd_state_update": ssd_state_update_ref, "selective_state_update": selective_state_update_mamba1_ref}
    for name, ref in refs.items():
        ours = inspect.signature(cpu_vendor_ops[name]).parameters
        theirs = inspect.signature(ref).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name


# ============================================================================ GPU: the real packages


gpu = pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")


def _real_mamba_ops() -> dict:
    pytest.importorskip("mamba_ssm", reason="mamba-ssm is not installed (benchmarks/build_vendor.sh builds it)")
    pytest.importorskip("causal_conv1d", reason="causal-conv1d is not installed (benchmarks/build_vendor.sh)")
    return vm.mamba_ssm_ops()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_gpu_causal_conv1d(dtype, seed):
    ops = _real_mamba_ops()
    lens, slots, has_init, num_slots = _packed(seed, max_len=300)
    dim, width = 64, 4 - seed % 3
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=g).to("cuda", dtype)
    weight = torch.randn(dim, width, generator=g).to("cuda", dtype)
    bias = torch.randn(dim, generator=g).to("cuda", dtype)
    pool = _fresh_pool((num_slots, dim, width - 1), has_init, slots, dtype, g, "cuda")
    qsl, idx, init = _meta(lens, slots, has_init, "cuda")
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, conv_states=ref_pool, query_start_loc=qsl, state_indices=idx,
                            has_initial_state=init)
    out = ops["causal_conv1d"](x, weight, bias, conv_states=pool, query_start_loc=qsl, state_indices=idx,
                               has_initial_state=init)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    _assert_pools(pool, ref_pool, tol)
    # decode step on the updated pool
    xd = torch.randn(len(slots), dim, generator=g).to("cuda", dtype)
    keep = [s for s, h in zip(slots, has_init, strict=True) if h] or slots[:1]
    didx = torch.tensor(keep, device="cuda")
    ref_pool = pool.clone().nan_to_num_(0.0)
    pool = ref_pool.clone()
    ref = causal_conv1d_update_ref(xd[:len(keep)], conv_states=ref_pool, weight=weight, bias=bias, state_indices=didx)
    out = ops["causal_conv1d_update"](xd[:len(keep)], conv_states=pool, weight=weight, bias=bias, state_indices=didx)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    _assert_pools(pool, ref_pool, tol)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_gpu_ssd_chunk_scan(dtype, seed):
    """Errors relative to the fp32 reference on the same inputs (Triton dots run in tf32 / bf16)."""
    ops = _real_mamba_ops()
    lens, slots, has_init, num_slots = _packed(seed, max_len=200, single=seed < 2)
    kw = _ssd_inputs(lens, seed, nheads=8, headdim=32, ngroups=2, dstate=32, dtype=dtype, device="cuda")
    if seed % 2:
        kw.pop("z")
    limit = (0.0, math.inf) if seed % 3 else (0.01, 0.5)
    g = torch.Generator().manual_seed(seed)
    pool = _fresh_pool((num_slots, 8, 32, 32), has_init, slots, torch.float32, g, "cuda")
    qsl, idx, init = _meta(lens, slots, has_init, "cuda")
    ref_pool = pool.clone()
    ref = ssd_chunk_scan_ref(**kw, chunk_size=64, query_start_loc=qsl, ssm_states=ref_pool, state_indices=idx,
                             has_initial_state=init, dt_limit=limit)
    out = ops["ssd_chunk_scan"](**kw, chunk_size=64, query_start_loc=qsl, ssm_states=pool, state_indices=idx,
                                has_initial_state=init, dt_limit=limit)
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert _rel(out, ref) < tol, _rel(out, ref)
    assert torch.equal(pool.isnan(), ref_pool.isnan())
    assert _rel(pool, ref_pool) < tol, _rel(pool, ref_pool)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["default", "limit", "no_bias_no_D"])
def test_gpu_state_updates(dtype, variant):
    ops = _real_mamba_ops()
    kw = _ssd_inputs([1] * 5, 3, nheads=8, headdim=32, ngroups=2, dstate=64, dtype=dtype, device="cuda")
    kw.pop("z")
    if variant == "limit":
        kw["dt_limit"] = (0.01, 0.5)
    elif variant == "no_bias_no_D":
        kw.pop("dt_bias")
        kw.pop("D")
    pool = torch.randn(9, 8, 32, 64, device="cuda")
    idx = torch.tensor([8, 0, 3, 5, 1], device="cuda")
    ref_pool = pool.clone()
    x, dt, A, B, C = (kw.pop(k) for k in ("x", "dt", "A", "B", "C"))
    ref = ssd_state_update_ref(ref_pool, x, dt, A, B, C, state_indices=idx, **kw)
    out = ops["ssd_state_update"](pool, x, dt, A, B, C, state_indices=idx, **kw)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(out, ref) < tol and _rel(pool, ref_pool) < 1e-4

    g = torch.Generator().manual_seed(5)
    dim, dstate = 96, 16
    x1, dt1 = (torch.randn(5, dim, generator=g).to("cuda", dtype) for _ in range(2))
    A1 = -torch.rand(dim, dstate, generator=g).cuda()
    B1, C1 = (torch.randn(5, dstate, generator=g).to("cuda", dtype) for _ in range(2))
    opt = {} if variant == "no_bias_no_D" else dict(D=torch.randn(dim, generator=g).cuda(),
                                                    dt_bias=torch.randn(dim, generator=g).cuda(),
                                                    z=torch.randn(5, dim, generator=g).to("cuda", dtype))
    pool1 = torch.randn(9, dim, dstate, device="cuda")
    ref_pool1 = pool1.clone()
    ref1 = selective_state_update_mamba1_ref(ref_pool1, x1, dt1, A1, B1, C1, state_indices=idx, **opt)
    out1 = ops["selective_state_update"](pool1, x1, dt1, A1, B1, C1, state_indices=idx, **opt)
    assert _rel(out1, ref1) < tol and _rel(pool1, ref_pool1) < 1e-4


@gpu
@pytest.mark.parametrize(("q_lens", "s_lens", "heads", "kv_heads", "d", "window", "softcap", "transform"), [
    ([1, 7, 300, 1], [9, 7, 300, 700], 8, 2, 64, None, None, None),
    ([1, 1, 1, 1], [3000, 17, 256, 1024], 8, 1, 128, None, None, None),
    ([40, 1, 300], [900, 600, 300], 4, 4, 128, 200, None, "trim"),
    ([30, 1, 290], [800, 500, 600], 8, 2, 64, None, 30.0, "local"),
    ([5, 100], [5, 300], 4, 2, 256, 64, 20.0, None),
])
def test_gpu_flash_attn(q_lens, s_lens, heads, kv_heads, d, window, softcap, transform):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (benchmarks/build_vendor.sh builds it)")
    op = vfa.flash_attn_ops()["paged_attention"]
    cam, q, k, v, scale = _make_attention_batch(q_lens, s_lens, 256, 1, heads=heads, kv_heads=kv_heads, d=d,
                                                dtype=torch.bfloat16, device="cuda")
    if transform == "trim":
        cam = trim_sliding_window(cam, window)
    elif transform == "local":
        cam = make_local_attention_virtual_batches(cam, 512)
    k, v = _poison_unreferenced(k, v, cam)
    cam = _cam_to(cam, "cuda")
    ref = paged_attention_ref(q.float(), k.float(), v.float(), cam, scale=scale, sliding_window=window,
                              softcap=softcap)
    out = op(q, k, v, cam, scale=scale, sliding_window=window, softcap=softcap)
    assert not out.isnan().any()
    assert _rel(out, ref) < 2e-2


def _flash_mix_config():
    """Every attention kind at flash-attn's page size (block 256): window 200 (trimmed tables), chunk 512
    (virtual batches), full; a Mamba2 layer between them (its ops stay triton's). bf16: FA2 takes no fp32."""
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2

    attn = dict(num_heads=4, num_kv_heads=2, head_dim=64)
    mixers = (Attention(sliding_window=200, **attn), Mamba2(num_heads=4, head_dim=32, state_size=16, n_groups=1),
              Attention(attention_chunk_size=512, **attn), Attention(**attn))
    return HybridConfig(vocab_size=256, hidden_size=128, max_position_embeddings=2048, dtype="bfloat16",
                        layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=256)) for m in mixers))


@gpu
def test_gpu_flash_attn_engine_matches_triton():
    """The whole engine on ``backend="flash_attn"`` (chunked prefill into mixed batches, decode under CUDA
    graphs) against ``backend="triton"`` on the same bf16 weights. Teacher-forced prompt logprobs agree
    position by position; greedy decoding agrees token for token until a step whose top two candidates were
    within bf16 noise of each other (a random model's logits are nearly flat), and every chosen token's
    logprob agrees up to there."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (benchmarks/build_vendor.sh builds it)")
    from hybridkv import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (700, 5, 260, 513, 1000, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=0)
    runs = {}
    for backend in ("triton", "flash_attn"):
        llm = LLM(_flash_mix_config(), device="cuda", backend=backend, block_size=256, max_num_seqs=8,
                  max_num_batched_tokens=512, kv_cache_memory=256 << 20, cuda_graphs=True, seed=0)
        assert llm.engine.runner.backend.name == backend and llm.engine.runner.graphs is not None
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    tol = 0.05
    for ref, out in zip(runs["triton"], runs["flash_attn"], strict=True):
        lp_ref = np.array([p.logprob for p in ref.prompt_logprobs[1:]])
        lp_out = np.array([p.logprob for p in out.prompt_logprobs[1:]])
        assert np.abs(lp_ref - lp_out).max() < tol
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
            if a.token_id != b.token_id:
                assert a.top[0][1] - a.top[1][1] < 2 * tol, "diverged on a step with a clear winner"
                break
            assert abs(a.logprob - b.logprob) < tol

"""The ``fla`` vendor backend (flash-linear-attention's gated delta rule and KDA): registry rules and the adapters'
argument mapping.

CPU part (always runs): fake ``fla`` modules implement the upstream calls' documented semantics (one flat packed
row with ``cu_seqlens``, one initial state per sequence, final states returned; the continuous-batching recurrent
kernel reading and writing the pool in place at ``ssm_state_indices``) as plain per-token loops, independently of
our references. Through them the adapters are checked against the ``*_ref`` ops on random packed batches.

GPU part: the real package against the references; skipped without CUDA or without fla.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import logging
import sys
import types

import numpy as np
import pytest
import torch

from hybridkv.backends import registry
from hybridkv.backends import vendor_fla as vf
from hybridkv.backends.registry import UnsupportedConfig, get_backend
from hybridkv.layers.ops import gated_delta_rule_ref, gated_delta_rule_update_ref, kda_ref, kda_update_ref

_HAS_CUDA = torch.cuda.is_available()
NAN = float("nan")
REFS = {"gated_delta_rule": gated_delta_rule_ref, "gated_delta_rule_update": gated_delta_rule_update_ref,
        "kda": kda_ref, "kda_update": kda_update_ref}


# ============================================================================ fake fla


def _fla_step(h, q, k, v, g, beta, scale, l2):
    """fla's recurrence for one token of one value head: h (K, V); g scalar or (K,)."""
    if l2:
        q = q / torch.sqrt((q * q).sum() + 1e-6)
        k = k / torch.sqrt((k * k).sum() + 1e-6)
    h = h * (torch.exp(g)[:, None] if g.dim() == 1 else torch.exp(g))
    v = (v - (h * k[:, None]).sum(0)) * beta
    h = h + k[:, None] * v[None, :]
    return h, (h * (q * scale)[:, None]).sum(0)


def _fake_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """chunk_gated_delta_rule / chunk_kda on a flat packed row ([1, T, ...] with cu_seqlens)."""
    assert not kwargs, kwargs
    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and output_final_state
    n = cu_seqlens.numel() - 1
    hk, kd = q.shape[2:]
    hv, vd = v.shape[2:]
    assert initial_state.shape == (n, hv, kd, vd) and initial_state.dtype == torch.float32
    scale = kd ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=torch.float32)
    final = initial_state.clone()
    for i in range(n):
        for h in range(hv):
            j = h // (hv // hk)
            s = final[i, h]
            for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
                s, o[0, t, h] = _fla_step(s, q[0, t, j].float(), k[0, t, j].float(), v[0, t, h].float(),
                                          g[0, t, h].float(), beta[0, t, h].float(), scale, use_qk_l2norm_in_kernel)
            final[i, h] = s
    return o.to(v.dtype), final


def _fake_recurrent_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=True,
                            ssm_state_indices=None, use_qk_l2norm_in_kernel=False, **kwargs):
    """fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd in continuous batching: [B, 1, ...] contiguous inputs,
    the state read from and written to initial_state[ssm_state_indices[b]]."""
    assert not kwargs, kwargs
    assert inplace_final_state and ssm_state_indices.dtype == torch.int32
    assert all(t.is_contiguous() for t in (q, k, v, g, beta))
    b, one, hk, kd = q.shape
    hv = v.shape[2]
    assert one == 1 and g.shape == (b, 1, hv, kd) and beta.shape == (b, 1, hv)
    scale = kd ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=torch.float32)
    for i in range(b):
        slot = int(ssm_state_indices[i])
        for h in range(hv):
            j = h // (hv // hk)
            s, o[i, 0, h] = _fla_step(initial_state[slot, h].float(), q[i, 0, j].float(), k[i, 0, j].float(),
                                      v[i, 0, h].float(), g[i, 0, h].float(), beta[i, 0, h].float(), scale,
                                      use_qk_l2norm_in_kernel)
            initial_state[slot, h] = s
    return o.to(v.dtype), initial_state


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def install_fake_fla(monkeypatch) -> None:
    for name in ("fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule",
                        _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=_fake_chunk))
    sys.modules["fla.ops.kda"].chunk_kda = _fake_chunk
    monkeypatch.setitem(sys.modules, "fla.ops.kda.fused_recurrent",
                        _module("fla.ops.kda.fused_recurrent", fused_recurrent_kda_fwd=_fake_recurrent_kda_fwd))


@pytest.fixture
def cpu_fla_ops(monkeypatch):
    """Adapters built on the fakes, with the CUDA-device check lifted so they run on CPU tensors."""
    install_fake_fla(monkeypatch)
    monkeypatch.setattr(vf, "_device_reason", lambda *t: None)
    return vf.fla_ops()


# ============================================================================ mapping (CPU, fakes)


def _case(seed: int, kind: str, *, gate: bool, batch: list[int] | None = None):
    rng = np.random.default_rng(seed)
    lens = batch or [int(x) for x in rng.choice([0, 1, 2, 5, 9, 13], size=int(rng.integers(1, 5)))]
    num_slots = len(lens) + 2
    slots = torch.tensor(rng.permutation(num_slots)[: len(lens)].tolist())
    has_init = torch.tensor([bool(x) for x in rng.integers(0, 2, size=len(lens))])
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    n, hk, hv, kd, vd = sum(lens), 1, 2, 4, 3
    g_shape = (n, hv, kd) if kind == "kda" else (n, hv)
    p = dict(q=torch.randn(n, hk, kd, generator=gen), k=torch.randn(n, hk, kd, generator=gen),
             v=torch.randn(n, hv, vd, generator=gen),
             g=torch.randn(*g_shape, generator=gen) if gate else -torch.rand(*g_shape, generator=gen),
             beta=torch.rand(n, hv, generator=gen), A_log=torch.randn(hv, generator=gen) if gate else None,
             dt_bias=torch.randn(*g_shape[1:], generator=gen) if gate else None)
    pool = torch.full((num_slots, hv, kd, vd), NAN)
    for s, init in zip(slots.tolist(), has_init.tolist(), strict=True):
        if init:
            pool[s] = torch.randn(hv, kd, vd, generator=gen)
    return p, dict(query_start_loc=qsl, state_indices=slots, has_initial_state=has_init), pool


@pytest.mark.parametrize("kind", ["gated_delta_rule", "kda"])
@pytest.mark.parametrize(("seed", "gate"), [(0, False), (1, True), (2, False), (3, True)])
def test_prefill_mapping_matches_reference(cpu_fla_ops, kind, seed, gate):
    p, meta, pool = _case(seed, "kda" if kind == "kda" else "gdn", gate=gate)
    ref_pool = pool.clone()
    ref = REFS[kind](**p, **meta, ssm_states=ref_pool, use_qk_l2norm=True, scale=0.4)
    out = cpu_fla_ops[kind](**p, **meta, ssm_states=pool, use_qk_l2norm=True, scale=0.4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_prefill_of_empty_requests_keeps_initial_states(cpu_fla_ops):
    p, meta, pool = _case(4, "gdn", gate=False, batch=[0, 0])
    ref_pool = pool.clone()
    gated_delta_rule_ref(**p, **meta, ssm_states=ref_pool)
    assert cpu_fla_ops["gated_delta_rule"](**p, **meta, ssm_states=pool).shape == p["v"].shape
    torch.testing.assert_close(pool, ref_pool, equal_nan=True)


@pytest.mark.parametrize("kind", ["gated_delta_rule_update", "kda_update"])
@pytest.mark.parametrize("gate", [False, True])
def test_update_mapping_matches_reference(cpu_fla_ops, kind, gate):
    p, meta, pool = _case(5, "kda" if kind == "kda_update" else "gdn", gate=gate, batch=[1, 1, 1])
    pool = torch.where(pool.isnan(), 0.25, pool)       # decode: every request continues from its slot
    spare = [s for s in range(pool.shape[0]) if s not in meta["state_indices"].tolist()]
    pool[spare] = NAN                                  # spare slots stay untouched
    ref_pool = pool.clone()
    kw = dict(state_indices=meta["state_indices"], use_qk_l2norm=True, A_log=p.pop("A_log"),
              dt_bias=p.pop("dt_bias"))
    ref = REFS[kind](ref_pool, **p, **kw)
    out = cpu_fla_ops[kind](pool, **p, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_signatures_match_the_references(cpu_fla_ops):
    """Same parameter names and kinds as the ``*_ref`` twins (the layers call them by keyword)."""
    for name, ref in REFS.items():
        ours = inspect.signature(cpu_fla_ops[name]).parameters
        theirs = inspect.signature(ref).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], name


def test_constraints_refuse_before_touching_state(monkeypatch):
    install_fake_fla(monkeypatch)
    ops = vf.fla_ops()
    p, meta, pool = _case(6, "gdn", gate=False, batch=[3])
    before = pool.clone()
    with pytest.raises(UnsupportedConfig, match="tensors are on cpu"):
        ops["gated_delta_rule"](**p, **meta, ssm_states=pool)
    monkeypatch.setattr(vf, "_device_reason", lambda *t: None)
    with pytest.raises(UnsupportedConfig, match="state dtype torch.bfloat16"):
        ops["gated_delta_rule"](**p, **meta, ssm_states=pool.bfloat16())
    big = {key: (t.repeat_interleave(80, -1) if key in ("q", "k") else t) for key, t in p.items()}
    with pytest.raises(UnsupportedConfig, match="head_k_dim 320 > 256"):
        ops["gated_delta_rule"](**big, **meta, ssm_states=pool.repeat_interleave(80, 2))
    torch.testing.assert_close(pool, before, equal_nan=True)


# ============================================================================ registry


def test_missing_fla_is_a_clear_error():
    if registry._importable("fla"):
        pytest.skip("fla is installed here")
    with pytest.raises(RuntimeError, match="'fla' needs the package.*pip install flash-linear-attention"):
        get_backend("fla", "cuda")


def test_explicit_fla_derives_from_triton(monkeypatch, caplog):
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fake_fla(monkeypatch)
    triton = get_backend("triton", "cuda")
    with caplog.at_level(logging.INFO, logger="hybridkv.backends"):
        be = get_backend("fla", "cuda")
    assert be.name == "fla"
    for op in REFS:
        assert getattr(be, op).__module__ == vf.__name__, op
    for op in ("paged_attention", "causal_conv1d", "ssd_chunk_scan", "rope_attention"):
        assert getattr(be, op) is getattr(triton, op), op
    assert "kernel backend: fla (requested" in caplog.text


def test_auto_takes_only_the_fla_ops_measured_faster(monkeypatch):
    """auto: fla's chunked KDA prefill (measured faster), behind a fallback to ours; every other delta-rule op ours."""
    pytest.importorskip("triton", reason="vendor backends derive from the triton backend")
    install_fake_fla(monkeypatch)
    triton = get_backend("triton", "cuda")
    be = get_backend("auto", "cuda")
    assert "fla" in be.name.split("+")
    assert be.kda.__wrapped__.__module__ == vf.__name__
    assert be.kda.fallback is triton.kda
    for op in REFS:
        if op != "kda":
            assert getattr(be, op) is getattr(triton, op), op
    monkeypatch.setitem(registry._AUTO_OPS, "fla", frozenset())
    be = get_backend("auto", "cuda")
    assert "fla" not in be.name.split("+")
    for op in REFS:
        assert getattr(be, op) is getattr(triton, op), op


# ============================================================================ GPU: the real package


@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fla_matches_reference(kind, dtype):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install flash-linear-attention)")
    ops = vf.fla_ops()
    rng = np.random.default_rng(7)
    lens = [int(x) for x in rng.integers(1, 300, 4)] + [1, 64, 0]
    num_slots = len(lens) + 2
    slots = torch.tensor(rng.permutation(num_slots)[: len(lens)].tolist()).cuda()
    has_init = torch.tensor([bool(x) for x in rng.integers(0, 2, size=len(lens))]).cuda()
    meta = dict(query_start_loc=torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32).cuda(),
                state_indices=slots, has_initial_state=has_init)
    n, hk, hv, d = sum(lens), (4 if kind == "gdn" else 8), 8, 128
    gen = torch.Generator().manual_seed(0)
    g_shape = (n, hv, d) if kind == "kda" else (n, hv)
    p = dict(q=torch.randn(n, hk, d, generator=gen), k=torch.randn(n, hk, d, generator=gen),
             v=torch.randn(n, hv, d, generator=gen), g=torch.randn(*g_shape, generator=gen),
             beta=torch.rand(n, hv, generator=gen), A_log=torch.randn(hv, generator=gen) - 1,
             dt_bias=torch.randn(*g_shape[1:], generator=gen))
    p = {key: t.to(dtype).float().cuda() if key in ("q", "k", "v") else t.cuda() for key, t in p.items()}
    pool = (torch.randn(num_slots, hv, d, d, generator=gen) * 0.1).cuda()
    ref_pool = pool.clone()
    prefill, update = ("kda", "kda_update") if kind == "kda" else ("gated_delta_rule", "gated_delta_rule_update")
    ref = REFS[prefill](**p, **meta, ssm_states=ref_pool, use_qk_l2norm=True)
    low = {key: (t.to(dtype) if key in ("q", "k", "v") else t) for key, t in p.items()}
    out = ops[prefill](**low, **meta, ssm_states=pool, use_qk_l2norm=True)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    assert rel(out, ref) < tol and rel(pool[slots], ref_pool[slots]) < tol
    one = {key: t[: len(lens)] for key, t in low.items() if key not in ("A_log", "dt_bias")}
    kw = dict(state_indices=slots, use_qk_l2norm=True, A_log=p["A_log"], dt_bias=p["dt_bias"])
    ref = REFS[update](ref_pool, **{key: t.float() for key, t in one.items()}, **kw)
    out = ops[update](pool, **one, **kw)
    assert rel(out, ref) < tol and rel(pool[slots], ref_pool[slots]) < tol

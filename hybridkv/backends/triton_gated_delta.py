"""Triton gated delta rule (Gated DeltaNet) and Kimi Delta Attention over packed requests with per-request state
slots: a chunked prefill kernel, a recurrent (token-by-token) prefill kernel and the one-token decode update.

Signatures are those of the references in ``hybridkv.layers.ops.gated_delta_ref`` plus optional keyword arguments
(``out``, ``check_values``), so the ``triton`` backend is a drop-in replacement checked against them
(tests/test_gated_delta_triton.py). The whole contract runs in the kernels: the optional gate
``-exp(A_log) * softplus(g + dt_bias)``, the optional q/k L2 norm, the q scale, value heads sharing a q/k head, the
fp32 state read where ``has_initial_state`` and written back to the slots, o in v's dtype. The recurrent and decode
kernels serve both layer kinds: ``PER_CHANNEL`` (KDA) makes the decay a (head_k_dim,) vector that scales the rows of
the state; the chunked prefill has a kernel pair for the gated delta rule and one kernel for KDA.

Kernel design (a program that carries a state owns one request, one value head and a block of ``BLOCK_V`` state
columns, and keeps its (head_k_dim, BLOCK_V) fp32 state tile in registers; the grids depend on shapes only, request
bounds come from ``query_start_loc`` on the device: no host sync, graph-safe):

- ``_wy_kernel`` + ``_wy_state_kernel`` (gated delta rule prefill, two launches). The packed tokens are cut into
  chunks of ``BT`` (not aligned to requests: each request's rows of a chunk are a segment of their own, found from
  ``query_start_loc``). The first kernel, one program per (chunk, value head), all in parallel: the segment-local
  cumulative log decay ``gc``, the strictly lower ``A[i, j] = beta_i k_i.k_j e^(gc_i - gc_j)`` (same segment),
  ``T = (I + A)^-1`` by diagonal blocks of 16 rows (forward substitution in every block at once, then the
  block-lower rest as a short Neumann product), and from it ``W = T (beta k e^gc)``, ``U = T (beta v)``, the
  decayed causal ``QK`` and the state pass's operands ``q e^gc``, ``k e^(gc_end - gc)``. The second, one program
  per (request, value head, BV state columns), walks the request's segments in order: ``v' = U - W S``,
  ``o = (q e^gc) S + QK v'``, ``S = S e^(gc_end) + (k e^(gc_end - gc))^T v'``; every load is a dot operand, so the
  loop carries only the state's dots. (One kernel doing the substitution inside that sequential loop, as KDA's
  below still does, ran 3.5 ms a layer on 8192 tokens of Qwen3-Next-like heads on an H200: 38% of the prefill.)
- ``_delta_chunk_kernel`` (KDA prefill): walks the request in chunks of ``BT`` tokens aligned to its first token (the
  tail masked: k = v = beta = g = 0 leaves the state exact, as the reference pads). Per chunk with start state S and
  in-chunk cumulative log decay ``gc`` (per channel): ``R = beta (v - (k e^gc) S)`` (tl.dot); the strictly lower
  ``A[i, j] = beta_i sum_c k_ic k_jc e^(gc_ic - gc_jc)``; ``u = (I + A)^-1 R`` by forward substitution over the
  chunk's rows (the UT transform, solved as the reference's ``solve_triangular`` does: BT steps of a row
  reduction); ``o = (q e^gc) S + (decayed q_i.k_j, j <= i) u``; ``S = S e^(gc_last) + (k e^(gc_last - gc))^T u``.
  Every exponent is a decay (<= 0): no overflow however fast the decay. The decay differs per channel, so the
  pairwise terms are summed over (BT, BT, BK) tiles of channels reloaded from L1 (a loop, not unrolled: unrolled,
  the loads of every tile are hoisted and spill). The phases are ordered so that few (BT, head_k_dim) tiles are
  live at once.
- ``_delta_recurrent_kernel`` (prefill, any length): the per-token recurrence of the naive reference, one token
  after the other; for short requests and as a second implementation to measure against.
- ``_delta_update_kernel`` (decode): one token per request, the program's state tile read from its slot, updated
  and written back in place. Two compiled forms (``jit_forms``): captured decode graphs specialize on everything,
  eager launches do not specialize on the per-step index tensor's alignment.

Dot operands are in the inputs' dtype (bf16 inputs: bf16 tensor-core dots with fp32 accumulation, the state rounded
to bf16 only as an operand, as in fla); fp32 inputs use exact fp32 dots.

Validation: as in ``triton_conv1d``: the reference's shape errors always (same messages, no sync), its value errors
(indices in range and distinct, ``query_start_loc`` rising from 0 to num_tokens) only with ``check_values=True`` (a
host sync). Without, an index outside ``[0, num_slots)`` is never dereferenced (the row computes from a zero state
and writes no state) and token ranges are clamped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.jit_forms import two_forms
from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_conv1d import _check_index, _check_qsl, _next_pow2, _on
from hybridkv.backends.triton_ssd import _softplus
from hybridkv.layers.ops.conv1d_ref import _check_state_indices, _packed_layout
from hybridkv.layers.ops.gated_delta_ref import L2NORM_EPS, _check_params

__all__ = [
    "delta_launch_config",
    "gated_delta_rule_recurrent_triton",
    "gated_delta_rule_triton",
    "gated_delta_rule_update_triton",
    "kda_recurrent_triton",
    "kda_triton",
    "kda_update_triton",
]


# --------------------------------------------------------------------------------------------- device helpers

@triton.jit
def _gate(g, a_log, dtb, HAS_GATE: tl.constexpr):
    """The log decay: g as given, or -exp(A_log) * softplus(g + dt_bias)."""
    if HAS_GATE:
        g = -tl.exp(a_log) * _softplus(g + dtb)
    return g


@triton.jit
def _beta(b, ty: tl.constexpr, BETA_LOGITS: tl.constexpr, BETA_SCALE: tl.constexpr):
    """The write strength: b as given, or from logits ``sigmoid(b) * BETA_SCALE``, each step rounded to the input
    dtype ``ty`` as the layer's torch ops round."""
    if BETA_LOGITS:
        b = (1.0 / (1.0 + tl.exp(-b))).to(ty).to(tl.float32)
        if BETA_SCALE != 1.0:
            b = (b * BETA_SCALE).to(ty).to(tl.float32)
    return b


@triton.jit
def _token_step(S, q, k, v, g, beta, PER_CHANNEL: tl.constexpr):
    """One token: S (K_P, BV) fp32; q, k (K_P,) prepared; v (BV,); g scalar or (K_P,); beta scalar."""
    if PER_CHANNEL:  # noqa: SIM108  (constexpr branch)
        S = S * tl.exp(g)[:, None]
    else:
        S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta
    S = S + k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], 0)


@triton.jit
def _head_params(alog_ptr, dtb_ptr, h, offs_k, k_ok, stride_dth, stride_dtk,
                 HAS_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """A_log[h] and dt_bias[h] (scalar, or (K_P,) for KDA) in fp32; zeros when absent."""
    a_log = 0.0
    if HAS_GATE:
        a_log = tl.load(alog_ptr + h).to(tl.float32)
    if PER_CHANNEL:
        dtb = tl.zeros_like(offs_k).to(tl.float32)
        if HAS_DT_BIAS:
            dtb = tl.load(dtb_ptr + h * stride_dth + offs_k * stride_dtk, mask=k_ok, other=0.0).to(tl.float32)
    else:
        dtb = 0.0
        if HAS_DT_BIAS:
            dtb = tl.load(dtb_ptr + h * stride_dth).to(tl.float32)
    return a_log, dtb


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, h, hk, offs_k, k_ok, offs_v, v_ok, a_log, dtb, scale,
                stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk, stride_vt, stride_vh, stride_vv,
                stride_gt, stride_gh, stride_gk, stride_bt, stride_bh,
                PER_CHANNEL: tl.constexpr, HAS_GATE: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
                BETA_LOGITS: tl.constexpr, BETA_SCALE: tl.constexpr):
    """Token t's prepared q (scaled), k, v, decay and beta for value head h (q/k head hk)."""
    t = tl.cast(t, tl.int64)
    q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k * stride_qk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k * stride_kk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v * stride_vv, mask=v_ok, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs_k * stride_gk, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.where(k_ok, _gate(g, a_log, dtb, HAS_GATE), 0.0)
    else:
        g = _gate(tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32), a_log, dtb, HAS_GATE)
    beta = _beta(tl.load(b_ptr + t * stride_bt + h * stride_bh).to(tl.float32), b_ptr.dtype.element_ty,
                 BETA_LOGITS, BETA_SCALE)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, 0) + EPS)
        k = k / tl.sqrt(tl.sum(k * k, 0) + EPS)
    return q * scale, k, v, g, beta


# --------------------------------------------------------------------------------------------- kernels

@triton.jit
def _request_state(state_ptr, qsl_ptr, idx_ptr, init_ptr, num_tokens, head_k_dim, head_v_dim, num_slots,
                   stride_ss, stride_sh, stride_sk, stride_sv, K_P: tl.constexpr, BV: tl.constexpr):
    """A sequential program's request and state tile: grid (value heads x value blocks, requests). Returns the
    value head, the request's token range (clamped), its state tile (K_P, BV) fp32 (zero unless the request
    continues from a valid slot), the tile's pointers and store mask (nothing stored for a bad slot), and the
    key / value offsets with their masks."""
    pid = tl.program_id(0)
    req = tl.program_id(1)
    n_vb = tl.cdiv(head_v_dim, BV)
    h = pid // n_vb
    t0 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req).to(tl.int32), 0), num_tokens)
    t1 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req + 1).to(tl.int32), t0), num_tokens)
    slot = tl.load(idx_ptr + req).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    use_state = slot_ok & (tl.load(init_ptr + req) != 0)
    offs_k = tl.arange(0, K_P)
    k_ok = offs_k < head_k_dim
    offs_v = (pid % n_vb) * BV + tl.arange(0, BV)
    v_ok = offs_v < head_v_dim
    s_ptrs = (state_ptr + tl.where(slot_ok, slot, 0) * stride_ss + h * stride_sh
              + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv)
    s_mask = k_ok[:, None] & v_ok[None, :]
    S = tl.load(s_ptrs, mask=tl.where(use_state, s_mask, False), other=0.0).to(tl.float32)
    return h, t0, t1, S, s_ptrs, tl.where(slot_ok, s_mask, False), offs_k, k_ok, offs_v, v_ok


@triton.jit(do_not_specialize=["num_tokens"],      # a per-step value: one compile serves every step
            do_not_specialize_on_alignment=["qsl_ptr", "idx_ptr", "init_ptr"])
def _delta_recurrent_kernel(
    o_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_tokens, head_k_dim, head_v_dim, rep, num_slots, scale,
    stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk, stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh, stride_gk, stride_bt, stride_bh, stride_ot, stride_oh, stride_ov,
    stride_dth, stride_dtk, stride_ss, stride_sh, stride_sk, stride_sv,
    K_P: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr, BETA_LOGITS: tl.constexpr = False,
    BETA_SCALE: tl.constexpr = 1.0, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    h, t0, t1, S, s_ptrs, s_store, offs_k, k_ok, offs_v, v_ok = _request_state(
        state_ptr, qsl_ptr, idx_ptr, init_ptr, num_tokens, head_k_dim, head_v_dim, num_slots,
        stride_ss, stride_sh, stride_sk, stride_sv, K_P, BV)
    hk = h // rep
    a_log, dtb = _head_params(alog_ptr, dtb_ptr, h, offs_k, k_ok, stride_dth, stride_dtk,
                              HAS_GATE, HAS_DT_BIAS, PER_CHANNEL)
    for t in range(t0, t1):
        q, k, v, g, beta = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, h, hk, offs_k, k_ok, offs_v, v_ok,
                                       a_log, dtb, scale, stride_qt, stride_qh, stride_qk, stride_kt, stride_kh,
                                       stride_kk, stride_vt, stride_vh, stride_vv, stride_gt, stride_gh, stride_gk,
                                       stride_bt, stride_bh, PER_CHANNEL, HAS_GATE, L2NORM, EPS, BETA_LOGITS,
                                       BETA_SCALE)
        S, o = _token_step(S, q, k, v, g, beta, PER_CHANNEL)
        tl.store(o_ptr + tl.cast(t, tl.int64) * stride_ot + h * stride_oh + offs_v * stride_ov,
                 o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_store)


def _delta_update(
    o_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, idx_ptr,
    head_k_dim, head_v_dim, rep, num_slots, scale,
    stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk, stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh, stride_gk, stride_bt, stride_bh, stride_ot, stride_oh, stride_ov,
    stride_dth, stride_dtk, stride_ss, stride_sh, stride_sk, stride_sv,
    K_P: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr, BETA_LOGITS: tl.constexpr = False,
    BETA_SCALE: tl.constexpr = 1.0, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n_vb = tl.cdiv(head_v_dim, BV)
    h = pid // n_vb
    hk = h // rep
    slot = tl.load(idx_ptr + b).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    offs_k = tl.arange(0, K_P)
    k_ok = offs_k < head_k_dim
    offs_v = (pid % n_vb) * BV + tl.arange(0, BV)
    v_ok = offs_v < head_v_dim
    s_ptrs = (state_ptr + tl.where(slot_ok, slot, 0) * stride_ss + h * stride_sh
              + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv)
    s_mask = tl.where(slot_ok, k_ok[:, None] & v_ok[None, :], False)       # a bad index is never dereferenced
    S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    a_log, dtb = _head_params(alog_ptr, dtb_ptr, h, offs_k, k_ok, stride_dth, stride_dtk,
                              HAS_GATE, HAS_DT_BIAS, PER_CHANNEL)
    q, k, v, g, beta = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, b, h, hk, offs_k, k_ok, offs_v, v_ok,
                                   a_log, dtb, scale, stride_qt, stride_qh, stride_qk, stride_kt, stride_kh,
                                   stride_kk, stride_vt, stride_vh, stride_vv, stride_gt, stride_gh, stride_gk,
                                   stride_bt, stride_bh, PER_CHANNEL, HAS_GATE, L2NORM, EPS, BETA_LOGITS,
                                   BETA_SCALE)
    S, o = _token_step(S, q, k, v, g, beta, PER_CHANNEL)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_mask)
    tl.store(o_ptr + tl.cast(b, tl.int64) * stride_ot + h * stride_oh + offs_v * stride_ov,
             o.to(o_ptr.dtype.element_ty), mask=v_ok)


# graph form specialized on everything; the eager form not on the per-step slot-index tensor's alignment
_delta_update_kernel = two_forms(_delta_update, per_step=[], per_step_pointers=["idx_ptr"])


@triton.jit
def _pair_per_channel(a_ptr, b_ptr, g_ptr, tok, l_ok, hk_a, hk_b, h, a_log, dtb_ptr, ra, rb,
                      stride_at, stride_ah, stride_ak, stride_bt, stride_bh, stride_bk,
                      stride_gt, stride_gh, stride_gk, stride_dth, stride_dtk, head_k_dim,
                      BT: tl.constexpr, BK: tl.constexpr, K_P: tl.constexpr, STRICT: tl.constexpr,
                      HAS_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """out[i, j] = sum_c ra_i a_i[c] rb_j b_j[c] exp(gc_i[c] - gc_j[c]) for j <= i (j < i if STRICT), else 0:
    the KDA pairwise terms, summed over (BT, BT, BK) tiles of channels. ra, rb: per-row scales (l2 norms)."""
    offs_l = tl.arange(0, BT)
    if STRICT:  # noqa: SIM108  (constexpr branch)
        keep = offs_l[:, None] > offs_l[None, :]
    else:
        keep = offs_l[:, None] >= offs_l[None, :]
    acc = tl.zeros([BT, BT], tl.float32)
    for c0 in range(0, K_P, BK):                 # not unrolled: unrolled, every tile's loads are hoisted (spills)
        offs_c = c0 + tl.arange(0, BK)
        c_ok = offs_c < head_k_dim
        m = l_ok[:, None] & c_ok[None, :]
        a = tl.load(a_ptr + tok[:, None] * stride_at + hk_a * stride_ah + offs_c[None, :] * stride_ak,
                    mask=m, other=0.0).to(tl.float32) * ra[:, None]
        b = tl.load(b_ptr + tok[:, None] * stride_bt + hk_b * stride_bh + offs_c[None, :] * stride_bk,
                    mask=m, other=0.0).to(tl.float32) * rb[:, None]
        g = tl.load(g_ptr + tok[:, None] * stride_gt + h * stride_gh + offs_c[None, :] * stride_gk,
                    mask=m, other=0.0).to(tl.float32)
        dtb = tl.zeros([BK], tl.float32)
        if HAS_DT_BIAS:
            dtb = tl.load(dtb_ptr + h * stride_dth + offs_c * stride_dtk, mask=c_ok, other=0.0).to(tl.float32)
        gc = tl.cumsum(tl.where(m, _gate(g, a_log, dtb[None, :], HAS_GATE), 0.0), 0)        # (BT, BK)
        diff = tl.where(keep[:, :, None], gc[:, None, :] - gc[None, :, :], 0.0)             # (BT, BT, BK) <= 0
        acc += tl.sum(a[:, None, :] * b[None, :, :] * tl.where(keep[:, :, None], tl.exp(diff), 0.0), 2)
    return acc


@triton.jit(do_not_specialize=["num_tokens"],      # a per-step value: one compile serves every step
            do_not_specialize_on_alignment=["qsl_ptr", "idx_ptr", "init_ptr"])
def _delta_chunk_kernel(
    o_ptr, state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_tokens, head_k_dim, head_v_dim, rep, num_slots, scale,
    stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk, stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh, stride_gk, stride_bt, stride_bh, stride_ot, stride_oh, stride_ov,
    stride_dth, stride_dtk, stride_ss, stride_sh, stride_sk, stride_sv,
    BT: tl.constexpr, K_P: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """KDA's chunked prefill (``PER_CHANNEL`` always: the gated delta rule has its two-launch form)."""
    tl.static_assert(PER_CHANNEL, "the chunked kernel is KDA's: the gated delta rule runs _wy_kernel")
    pdl_wait(PDL)
    h, t0, t1, S, s_ptrs, s_store, offs_k, k_ok, offs_v, v_ok = _request_state(
        state_ptr, qsl_ptr, idx_ptr, init_ptr, num_tokens, head_k_dim, head_v_dim, num_slots,
        stride_ss, stride_sh, stride_sk, stride_sv, K_P, BV)
    hk = h // rep
    seq_len = t1 - t0
    a_log, dtb = _head_params(alog_ptr, dtb_ptr, h, offs_k, k_ok, stride_dth, stride_dtk,
                              HAS_GATE, HAS_DT_BIAS, PER_CHANNEL)

    offs_l = tl.arange(0, BT)
    dot_dtype = k_ptr.dtype.element_ty                  # the dots' operand dtype: the inputs'
    # Phases ordered so that few (BT, K_P) tiles are live at once (each is 32 registers a thread at BT 32): keys ->
    # R and A; the substitution; then queries -> o; the state update from the keys kept in the dot dtype.
    for c0 in range(0, seq_len, BT):
        l_ok = c0 + offs_l < seq_len
        tok = (t0 + c0 + offs_l).to(tl.int64)
        qk_mask = l_ok[:, None] & k_ok[None, :]
        beta = tl.load(b_ptr + tok * stride_bt + h * stride_bh, mask=l_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok[:, None] * stride_gt + h * stride_gh + offs_k[None, :] * stride_gk,
                    mask=qk_mask, other=0.0).to(tl.float32)
        g = tl.where(qk_mask, _gate(g, a_log, dtb[None, :], HAS_GATE), 0.0)
        gc = tl.cumsum(g, 0)                                          # (BT, K_P) log decay from the chunk start
        glast = tl.sum(g, 0)                                          # (K_P,)
        Sd = S.to(dot_dtype)

        # keys: u <- R = beta (v - (k e^gc) S), and the strictly lower A
        k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + offs_k[None, :] * stride_kk,
                    mask=qk_mask, other=0.0).to(tl.float32)
        rk = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            rk = 1.0 / tl.sqrt(tl.sum(k * k, 1) + EPS)
            k = k * rk[:, None]
        v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + offs_v[None, :] * stride_vv,
                    mask=l_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)                 # (BT, BV)
        u = beta[:, None] * (v - tl.dot((k * tl.exp(gc)).to(dot_dtype), Sd, input_precision=PRECISION))
        kd = k.to(dot_dtype)
        A = _pair_per_channel(k_ptr, k_ptr, g_ptr, tok, l_ok, hk, hk, h, a_log, dtb_ptr, rk * beta, rk,
                              stride_kt, stride_kh, stride_kk, stride_kt, stride_kh, stride_kk,
                              stride_gt, stride_gh, stride_gk, stride_dth, stride_dtk, head_k_dim,
                              BT, BK, K_P, True, HAS_GATE, HAS_DT_BIAS)

        # u = (I + A)^-1 R, row by row: u_i = R_i - sum_{j<i} A_ij u_j
        for i in range(0, tl.minimum(BT, seq_len - c0)):
            a_i = tl.sum(tl.where(offs_l[:, None] == i, A, 0.0), 0)                   # (BT,) row i of A
            u -= tl.where(offs_l[:, None] == i, tl.sum(a_i[:, None] * u, 0)[None, :], 0.0)
        ud = u.to(dot_dtype)

        # queries: o = (q e^gc) S + (q_i . k_j decayed, j <= i) u
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + offs_k[None, :] * stride_qk,
                    mask=qk_mask, other=0.0).to(tl.float32)
        rq = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            rq = 1.0 / tl.sqrt(tl.sum(q * q, 1) + EPS)
        rq = rq * scale
        q = q * rq[:, None]
        QK = _pair_per_channel(q_ptr, k_ptr, g_ptr, tok, l_ok, hk, hk, h, a_log, dtb_ptr, rq, rk,
                               stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk,
                               stride_gt, stride_gh, stride_gk, stride_dth, stride_dtk, head_k_dim,
                               BT, BK, K_P, False, HAS_GATE, HAS_DT_BIAS)
        o = (tl.dot((q * tl.exp(gc)).to(dot_dtype), Sd, input_precision=PRECISION)
             + tl.dot(QK.to(dot_dtype), ud, input_precision=PRECISION))
        tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :] * stride_ov,
                 o.to(o_ptr.dtype.element_ty), mask=l_ok[:, None] & v_ok[None, :])

        # S <- S e^(gc_last) + (k e^(gc_last - gc))^T u
        k_out = kd.to(tl.float32) * tl.exp(glast[None, :] - gc)
        S = S * tl.exp(glast)[:, None] + tl.dot(tl.trans(k_out.to(dot_dtype)), ud, input_precision=PRECISION)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_store)


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])    # per-step values: one compile serves every step
def _wy_kernel(
    w_ptr, u_ptr, qk_ptr, qg_ptr, kg_ptr, gc_ptr, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr,
    num_tokens, num_reqs, head_k_dim, head_v_dim, rep, scale,
    stride_qt, stride_qh, stride_qk, stride_kt, stride_kh, stride_kk, stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_dth,
    BT: tl.constexpr, SB: tl.constexpr, K_P: tl.constexpr, V_P: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr, PRECISION: tl.constexpr,
    BETA_LOGITS: tl.constexpr = False, BETA_SCALE: tl.constexpr = 1.0, PDL: tl.constexpr = False,
):
    """One (chunk of BT packed tokens, value head). Each request's rows of the chunk are a segment that starts
    from the request's state on entering it. Writes, per row: W = T (beta k e^gc) and U = T (beta v) with
    T = (I + A)^-1; QK, the segment-causal decayed q.k; q e^gc and k e^(gc_end - gc) (the state pass's dot
    operands); gc, the log decay since the segment's start."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // rep
    NB: tl.constexpr = BT // SB
    offs_l = tl.arange(0, BT)
    tok = (c * BT + offs_l).to(tl.int64)
    l_ok = tok < num_tokens
    rows = tok * tl.num_programs(1) + h                    # (token, value head): the outputs' row
    # each row's request: the number of request bounds at or before it (qsl[0] and qsl[num_reqs] too: rows before
    # the first request or after the last are segments of their own)
    seg = tl.zeros([BT], tl.int32)
    for r0 in range(0, num_reqs + 1, BT):
        r = r0 + offs_l
        starts = tl.load(qsl_ptr + r, mask=r <= num_reqs, other=num_tokens).to(tl.int64)
        seg += tl.sum((starts[None, :] <= tok[:, None]).to(tl.int32), 1)
    same = (seg[:, None] == seg[None, :]) & l_ok[:, None] & l_ok[None, :]
    causal = same & (offs_l[:, None] >= offs_l[None, :])
    offs_k = tl.arange(0, K_P)
    k_ok = offs_k < head_k_dim
    offs_v = tl.arange(0, V_P)
    v_ok = offs_v < head_v_dim
    qk_mask = l_ok[:, None] & k_ok[None, :]
    dot_dtype = k_ptr.dtype.element_ty

    a_log, dtb = _head_params(alog_ptr, dtb_ptr, h, offs_k, k_ok, stride_dth, 0, HAS_GATE, HAS_DT_BIAS, False)
    g = tl.load(g_ptr + tok * stride_gt + h * stride_gh, mask=l_ok, other=0.0).to(tl.float32)
    g = tl.where(l_ok, _gate(g, a_log, dtb, HAS_GATE), 0.0)
    gc = tl.sum(tl.where(causal, g[None, :], 0.0), 1)                       # (BT,)
    gend = tl.sum(tl.where(same, g[None, :], 0.0), 1)                       # (BT,) gc at the segment's last row
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))       # (BT, BT)
    beta = tl.load(b_ptr + tok * stride_bt + h * stride_bh, mask=l_ok, other=0.0).to(tl.float32)
    beta = tl.where(l_ok, _beta(beta, b_ptr.dtype.element_ty, BETA_LOGITS, BETA_SCALE), 0.0)

    k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + offs_k[None, :] * stride_kk,
                mask=qk_mask, other=0.0).to(tl.float32)
    if L2NORM:
        k = k / tl.sqrt(tl.sum(k * k, 1) + EPS)[:, None]
    kd = k.to(dot_dtype)
    A = tl.where(causal & (offs_l[:, None] > offs_l[None, :]),
                 tl.dot(kd, tl.trans(kd), input_precision=PRECISION) * decay, 0.0) * beta[:, None]
    # T = (I + A)^-1 by blocks of SB rows: the diagonal blocks' inverses D by forward substitution, all blocks at
    # once (SB - 1 steps); then with N = D A_off (strictly block-lower, so N^NB = 0),
    # T X = (I + N)^-1 D X = Y - N Y + N^2 Y - ... for Y = D X (Horner: NB - 1 products).
    A3 = tl.reshape(tl.where((offs_l[:, None] // SB) == (offs_l[None, :] // SB), A, 0.0), (NB, SB, BT))
    A3 = tl.sum(tl.reshape(A3, (NB, SB, NB, SB)), 2)                        # (NB, SB, SB) diagonal blocks
    offs_s = tl.arange(0, SB)
    rloc = offs_s[None, :, None]
    D3 = tl.where(rloc == offs_s[None, None, :], 1.0, 0.0) + tl.zeros([NB, SB, SB], tl.float32)
    for i in range(1, SB):            # row i of every block: e_i - sum_{j<i} A_ij D_j (rows j < i are final)
        a_i = tl.sum(tl.where(rloc == i, A3, 0.0), 1)                                      # (NB, SB)
        D3 -= tl.where(rloc == i, tl.sum(a_i[:, :, None] * D3, 1)[:, None, :], 0.0)
    N = tl.reshape(tl.dot(D3, tl.reshape(tl.where((offs_l[:, None] // SB) > (offs_l[None, :] // SB), A, 0.0),
                                         (NB, SB, BT)), input_precision=PRECISION), (BT, BT))

    kb = tl.reshape(k * (beta * tl.exp(gc))[:, None], (NB, SB, K_P))
    Y = tl.reshape(tl.dot(D3, kb, input_precision=PRECISION), (BT, K_P))
    W = Y
    for _ in range(NB - 1):
        W = Y - tl.dot(N, W, input_precision=PRECISION)
    tl.store(w_ptr + rows[:, None] * K_P + offs_k[None, :], W.to(w_ptr.dtype.element_ty), mask=qk_mask)
    tl.store(kg_ptr + rows[:, None] * K_P + offs_k[None, :],
             (kd.to(tl.float32) * tl.exp(gend - gc)[:, None]).to(kg_ptr.dtype.element_ty), mask=qk_mask)
    v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + offs_v[None, :] * stride_vv,
                mask=l_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    Y = tl.reshape(tl.dot(D3, tl.reshape(v * beta[:, None], (NB, SB, V_P)), input_precision=PRECISION), (BT, V_P))
    U = Y
    for _ in range(NB - 1):
        U = Y - tl.dot(N, U, input_precision=PRECISION)
    tl.store(u_ptr + rows[:, None] * V_P + offs_v[None, :], U, mask=l_ok[:, None] & v_ok[None, :])

    q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + offs_k[None, :] * stride_qk,
                mask=qk_mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, 1) + EPS)[:, None]
    q = q * scale
    QK = tl.where(causal, tl.dot(q.to(dot_dtype), tl.trans(kd), input_precision=PRECISION) * decay, 0.0)
    tl.store(qk_ptr + rows[:, None] * BT + offs_l[None, :], QK.to(qk_ptr.dtype.element_ty), mask=l_ok[:, None])
    tl.store(qg_ptr + rows[:, None] * K_P + offs_k[None, :],
             (q * tl.exp(gc)[:, None]).to(qg_ptr.dtype.element_ty), mask=qk_mask)
    tl.store(gc_ptr + rows, gc, mask=l_ok)


@triton.jit(do_not_specialize=["num_tokens"],      # a per-step value: one compile serves every step
            do_not_specialize_on_alignment=["qsl_ptr", "idx_ptr", "init_ptr"])
def _wy_state_kernel(
    o_ptr, state_ptr, w_ptr, u_ptr, qk_ptr, qg_ptr, kg_ptr, gc_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_tokens, head_k_dim, head_v_dim, num_slots, stride_ot, stride_oh, stride_ov,
    stride_ss, stride_sh, stride_sk, stride_sv,
    BT: tl.constexpr, K_P: tl.constexpr, V_P: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (request, value head, BV state columns): the state pass over the request's segments of the packed
    chunks, in order. Per segment with entering state S: v' = U - W S; o = (q e^gc) S + QK v';
    S <- S e^(gc_end) + (k e^(gc_end - gc))^T v'. Every load is a dot operand or U: nothing waits on the state
    but the dots."""
    pdl_wait(PDL)
    h, t0, t1, S, s_ptrs, s_store, offs_k, k_ok, offs_v, v_ok = _request_state(
        state_ptr, qsl_ptr, idx_ptr, init_ptr, num_tokens, head_k_dim, head_v_dim, num_slots,
        stride_ss, stride_sh, stride_sk, stride_sv, K_P, BV)
    num_heads = tl.num_programs(0) // tl.cdiv(head_v_dim, BV)
    offs_l = tl.arange(0, BT)
    dot_dtype = w_ptr.dtype.element_ty
    c_end = tl.where(t1 > t0, tl.cdiv(t1, BT), t0 // BT)
    for c in range(t0 // BT, c_end):
        tok = (c * BT + offs_l).to(tl.int64)
        m = (tok >= t0) & (tok < t1)
        rows = tok * num_heads + h
        mk = m[:, None] & k_ok[None, :]
        gend = tl.load(gc_ptr + (tl.minimum(t1, c * BT + BT) - 1).to(tl.int64) * num_heads + h)
        W = tl.load(w_ptr + rows[:, None] * K_P + offs_k[None, :], mask=mk, other=0.0)
        U = tl.load(u_ptr + rows[:, None] * V_P + offs_v[None, :], mask=m[:, None] & v_ok[None, :], other=0.0)
        QK = tl.load(qk_ptr + rows[:, None] * BT + offs_l[None, :], mask=m[:, None] & m[None, :], other=0.0)
        qg = tl.load(qg_ptr + rows[:, None] * K_P + offs_k[None, :], mask=mk, other=0.0)
        kg = tl.load(kg_ptr + rows[:, None] * K_P + offs_k[None, :], mask=mk, other=0.0)
        Sd = S.to(dot_dtype)
        vd = (U - tl.dot(W, Sd, input_precision=PRECISION)).to(dot_dtype)                # (BT, BV)
        o = tl.dot(qg, Sd, input_precision=PRECISION) + tl.dot(QK, vd, input_precision=PRECISION)
        tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :] * stride_ov,
                 o.to(o_ptr.dtype.element_ty), mask=m[:, None] & v_ok[None, :])
        S = S * tl.exp(gend) + tl.dot(tl.trans(kg), vd, input_precision=PRECISION)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_store)


# --------------------------------------------------------------------------------------------- host side

_WY_BLOCK = 16      # rows of the diagonal blocks the chunk's (I + A)^-1 is solved by (tl.dot's smallest side)


def delta_launch_config(*, head_k_dim: int, head_v_dim: int, per_channel: bool, kind: str) -> dict[str, int]:
    """Tile shapes (``kind``: "chunk", "recurrent" or "update"; ``benchmarks/gpu_delta_rule.py --sweep`` times the
    alternatives). The gated delta rule's two-launch prefill: BT 32, BV 64 (32 past head_k_dim 128), 8 warps and
    2 stages for the state pass, 4 warps for the factors (the sweep's best on an H200 at 16/16 and 16/32 heads of
    128, 1 x 4096 tokens: 0.50 / 0.66 ms; BT 64 within 1% at 16/16 heads, 19% slower at 16/32). The rest chosen
    so that nothing spills: every program keeps a (head_k_dim, BV) fp32 state and (BT, head_k_dim) q/k tiles in
    registers.
    Register use of the sm_90 builds at head dims 128, bf16 (triton 3.9, ``cuobjdump -res-usage``): KDA chunked,
    BT 16 x BV 32 x 8 warps: 242 registers (channel tiles of 16), no spill; BT 32 spills at 4 and 8 warps, BT 16
    at 4 warps; head_k_dim 256 spills at BV 32, so BV 16 there. Decode update and recurrent prefill, BV 32 x 4
    warps: 193 / 201 registers, no spill (2 warps spill)."""
    k_p = max(16, _next_pow2(head_k_dim))
    bv = max(16, min(16 if k_p > 128 else 32, _next_pow2(head_v_dim)))
    if kind == "chunk" and per_channel:
        return {"BT": 16, "BK": 16, "BV": bv, "num_warps": 8 if k_p >= 128 else 4, "num_stages": 1}
    if kind == "chunk":     # the two-launch gated delta rule (``--sweep gdn`` on an H200, 1 x 4096 tokens)
        return {"BT": 32, "BV": max(16, min(64 if k_p <= 128 else 32, _next_pow2(head_v_dim))), "num_warps": 8,
                "num_stages": 2, "wy_warps": 4}
    return {"BV": bv, "num_warps": 4 if head_k_dim >= 64 else 2}


def _check_devices(v: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != v.device:
            raise ValueError(f"{name} is on {t.device}, v on {v.device}: the kernel needs one device")


def _common_args(q, k, v, g, beta, A_log, dt_bias, out, ssm_states, scale, rep, per_channel):
    head_k_dim = q.shape[2]
    g_strides = tuple(g.stride()) if per_channel else (*g.stride(), 0)
    dtb_strides = (0, 0) if dt_bias is None else (dt_bias.stride(0), dt_bias.stride(1) if per_channel else 0)
    return (
        q, k, v, g, beta, A_log if A_log is not None else beta, dt_bias if dt_bias is not None else beta,
    ), (
        head_k_dim, v.shape[2], rep, ssm_states.shape[0], float(head_k_dim ** -0.5 if scale is None else scale),
        *q.stride(), *k.stride(), *v.stride(), *g_strides, *beta.stride(), *out.stride(), *dtb_strides,
        *ssm_states.stride(),
    )


def _flags(per_channel, A_log, dt_bias, use_qk_l2norm, beta_scale=None):
    """The kernels' constexprs; beta from logits (``BETA_LOGITS``, ``BETA_SCALE``) only where asked for (the KDA
    ops never are)."""
    beta = {} if beta_scale is None else dict(BETA_LOGITS=True, BETA_SCALE=float(beta_scale))
    return dict(PER_CHANNEL=per_channel, HAS_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
                L2NORM=bool(use_qk_l2norm), EPS=L2NORM_EPS, **beta)


def _prefill(
    q, k, v, g, beta, *, query_start_loc, ssm_states, state_indices, has_initial_state, scale, use_qk_l2norm,
    A_log, dt_bias, chunk_size, out, check_values, per_channel: bool, chunked: bool, beta_scale: float | None = None,
) -> torch.Tensor:
    rep = _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_reqs = _check_qsl(query_start_loc)
    _check_index("state_indices", state_indices, num_reqs)
    _check_index("has_initial_state", has_initial_state, num_reqs)
    num_tokens, num_v_heads, head_v_dim = v.shape
    if check_values:
        _packed_layout(num_tokens, query_start_loc, state_indices, has_initial_state, ssm_states.shape[0], v.device)
    _check_devices(v, q=q, k=k, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    elif out.shape != v.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(v.shape)}")
    head_k_dim = q.shape[2]
    if num_reqs == 0 or num_v_heads == 0 or head_v_dim == 0:
        return out
    cfg = delta_launch_config(head_k_dim=head_k_dim, head_v_dim=head_v_dim, per_channel=per_channel,
                              kind="chunk" if chunked else "recurrent")
    dev = v.device
    qsl, idx = _on(query_start_loc, dev), _on(state_indices, dev)
    init = _on(has_initial_state, dev).view(torch.uint8)
    ptrs, scalars = _common_args(q, k, v, g, beta, A_log, dt_bias, out, ssm_states, scale, rep, per_channel)
    k_p = max(16, _next_pow2(head_k_dim))
    grid = (num_v_heads * triton.cdiv(head_v_dim, cfg["BV"]), num_reqs)
    flags = _flags(per_channel, A_log, dt_bias, use_qk_l2norm, beta_scale)
    if chunked and not per_channel:
        _wy_prefill(out, ssm_states, q, k, v, g, beta, A_log, dt_bias, qsl, idx, init, scalars, cfg, k_p, flags)
    elif chunked:
        _delta_chunk_kernel[grid](
            out, ssm_states, *ptrs, qsl, idx, init, num_tokens, *scalars,
            BT=cfg["BT"], K_P=k_p, BK=min(cfg["BK"], k_p), BV=cfg["BV"], **flags,
            PRECISION="ieee" if v.dtype == torch.float32 else "tf32",
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(dev),
        )
    else:
        _delta_recurrent_kernel[grid](
            out, ssm_states, *ptrs, qsl, idx, init, num_tokens, *scalars,
            K_P=k_p, BV=cfg["BV"], **flags, num_warps=cfg["num_warps"], **pdl_kwargs(dev),
        )
    return out


def _wy_prefill(out, ssm_states, q, k, v, g, beta, A_log, dt_bias, qsl, idx, init, scalars, cfg, k_p, flags):
    """The gated delta rule's chunked prefill in two launches: the chunk-local factors in parallel over every
    (chunk, value head), then the state pass, sequential over each request's chunks (module docstring)."""
    num_tokens, num_v_heads, head_v_dim = v.shape
    head_k_dim, rep, scale = q.shape[2], scalars[2], scalars[4]
    bt, v_p, dev = cfg["BT"], max(16, _next_pow2(head_v_dim)), v.device
    rows_k = torch.empty(3, num_tokens, num_v_heads, k_p, dtype=k.dtype, device=dev)   # W | q e^gc | k e^(end-gc)
    u = torch.empty(num_tokens, num_v_heads, v_p, dtype=torch.float32, device=dev)     # T beta v
    qk = torch.empty(num_tokens, num_v_heads, bt, dtype=k.dtype, device=dev)           # decayed causal q.k
    gc = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=dev)         # in-segment log decay
    w, qg, kg = rows_k.unbind(0)
    dtb = dt_bias if dt_bias is not None else beta
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    _wy_kernel[(triton.cdiv(num_tokens, bt), num_v_heads)](
        w, u, qk, qg, kg, gc, q, k, v, g, beta, A_log if A_log is not None else beta, dtb, qsl, num_tokens,
        qsl.shape[0] - 1, head_k_dim, head_v_dim, rep, scale, *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *beta.stride(), dtb.stride(0), BT=bt, SB=_WY_BLOCK, K_P=k_p, V_P=v_p, HAS_GATE=flags["HAS_GATE"],
        HAS_DT_BIAS=flags["HAS_DT_BIAS"], L2NORM=flags["L2NORM"], EPS=flags["EPS"], PRECISION=precision,
        BETA_LOGITS=flags.get("BETA_LOGITS", False), BETA_SCALE=flags.get("BETA_SCALE", 1.0),
        num_warps=cfg["wy_warps"], num_stages=1, **pdl_kwargs(dev))
    _wy_state_kernel[(num_v_heads * triton.cdiv(head_v_dim, cfg["BV"]), qsl.shape[0] - 1)](
        out, ssm_states, w, u, qk, qg, kg, gc, qsl, idx, init, num_tokens, head_k_dim, head_v_dim,
        ssm_states.shape[0], *out.stride(), *ssm_states.stride(), BT=bt, K_P=k_p, V_P=v_p, BV=cfg["BV"],
        PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(dev))


def _decode(
    ssm_states, q, k, v, g, beta, *, state_indices, scale, use_qk_l2norm, A_log, dt_bias, out, check_values,
    per_channel: bool, beta_scale: float | None = None,
) -> torch.Tensor:
    rep = _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
    batch, num_v_heads, head_v_dim = v.shape
    if check_values:
        _check_state_indices(state_indices, batch, ssm_states.shape[0])
    else:
        _check_index("state_indices", state_indices, batch)
    _check_devices(v, q=q, k=k, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    elif out.shape != v.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(v.shape)}")
    head_k_dim = q.shape[2]
    if batch == 0 or num_v_heads == 0 or head_v_dim == 0:
        return out
    cfg = delta_launch_config(head_k_dim=head_k_dim, head_v_dim=head_v_dim, per_channel=per_channel, kind="update")
    idx = _on(state_indices, v.device)
    ptrs, scalars = _common_args(q, k, v, g, beta, A_log, dt_bias, out, ssm_states, scale, rep, per_channel)
    grid = (num_v_heads * triton.cdiv(head_v_dim, cfg["BV"]), batch)
    _delta_update_kernel.pick(v)[grid](
        out, ssm_states, *ptrs, idx, *scalars,
        K_P=max(16, _next_pow2(head_k_dim)), BV=cfg["BV"], **_flags(per_channel, A_log, dt_bias, use_qk_l2norm,
                                                                    beta_scale),
        num_warps=cfg["num_warps"], **pdl_kwargs(v.device),
    )
    return out


def gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    beta_scale: float | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``gated_delta_rule_ref`` (any strides), by the chunked kernel. ``chunk_size`` is validated
    like the reference's but the kernel blocks by its own ``BT`` (the algebra is exact for any blocking).
    ``out``: optional (num_tokens, num_v_heads, head_v_dim) destination; ``check_values``: also run the
    reference's value checks (host sync)."""
    return _prefill(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, out=out,
                    check_values=check_values, per_channel=False, chunked=True, beta_scale=beta_scale)


def gated_delta_rule_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    beta_scale: float | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """``gated_delta_rule_triton`` by the token-by-token kernel (``chunk_size`` only validated)."""
    return _prefill(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, out=out,
                    check_values=check_values, per_channel=False, chunked=False, beta_scale=beta_scale)


def gated_delta_rule_update_triton(
    ssm_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_scale: float | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``gated_delta_rule_update_ref``: one launch, grid from shapes only (CUDA-graph capturable),
    state slots updated in place. ``out`` / ``check_values`` as in ``gated_delta_rule_triton``."""
    return _decode(ssm_states, q, k, v, g, beta, state_indices=state_indices, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, out=out, check_values=check_values,
                   per_channel=False, beta_scale=beta_scale)


def kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``kda_ref``, by the chunked kernel with per-channel decay (see ``gated_delta_rule_triton``)."""
    return _prefill(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, out=out,
                    check_values=check_values, per_channel=True, chunked=True)


def kda_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """``kda_triton`` by the token-by-token kernel (``chunk_size`` only validated)."""
    return _prefill(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, out=out,
                    check_values=check_values, per_channel=True, chunked=False)


def kda_update_triton(
    ssm_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``kda_update_ref`` (see ``gated_delta_rule_update_triton``)."""
    return _decode(ssm_states, q, k, v, g, beta, state_indices=state_indices, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, out=out, check_values=check_values,
                   per_channel=True)

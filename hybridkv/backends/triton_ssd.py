"""Triton Mamba2 SSD: the chunked scan over packed requests with per-request state slots (one fused
kernel) and the one-token decode state update.

Signatures are those of the references ``ssd_chunk_scan_ref`` / ``ssd_state_update_ref``
(``hybridkv.layers.ops.ssd_ref``) plus optional keyword arguments, so the ``triton`` backend is a drop-in
replacement checked against them (tests/test_triton_mamba.py). The whole reference contract is done in
the kernels: dt + dt_bias, softplus, clamp to dt_limit, ``dA = exp(dt * A)``, the D skip (per head or per
(head, channel)), the ``silu(z)`` gate, fp32 state read where ``has_initial_state`` and written back to the
slots, y in x's dtype.

Kernel design:

- ``_ssd_scan_kernel``: grid = (nheads x P-blocks, num_reqs); one program owns (request, head, block of
  ``BLOCK_P`` head channels) and walks the request's tokens in chunks of ``CHUNK`` with the
  (BLOCK_P, N) state in registers, in fp32. Per chunk (positions ``l`` inside the chunk, masked past the
  request's end with dt = 0, i.e. decay 1 and no input, as the reference pads):
  ``cum = cumsum(dt * A)``; ``CB = C @ B^T`` (tl.dot); the intra-chunk term
  ``(CB * exp(cum[l] - cum[s]) * dt[s], s <= l) @ x``; the inter-chunk term ``(C @ state) * exp(cum[l])``;
  then ``state = state * exp(cum[-1]) + (x * exp(cum[-1] - cum) * dt)^T @ B``. Request boundaries come
  from ``query_start_loc`` loaded on the device, the grid from shapes only: no host sync, graph-safe.
  Chunks are aligned to each request's first token (like the reference); ``CHUNK`` is a tile size, not the
  model's ``chunk_size`` (which the reference also only uses for blocking: results agree to rounding).
  Dot operands are in x's dtype (bf16 inputs: bf16 tensor-core dots with fp32 accumulation, the state
  rounded to bf16 only as an operand of ``C @ state``, as in mamba-ssm); fp32 inputs use exact fp32 dots.
  B is loaded twice per chunk, as B^T (N, CHUNK) for ``C @ B^T`` and as (CHUNK, N) for the state update,
  so that no loaded tile is a transposed A operand of a Hopper wgmma: with B/C row strides that are not
  multiples of 16 elements, triton 3.6 compiled that form (``B^T @ xw``) into an out-of-bounds
  shared-memory read (illegal memory access on an H100; tests/test_triton_mamba.py's bf16 test has such
  strides). The second load hits L1/L2. A one-token request takes the update kernel's arithmetic instead (in
  fp32, no tiles): the mixed-step graphs send decodes through the scan.
- ``_ssd_update_kernel`` (decode): grid = (nheads x P-blocks, batch); the program reads its (BLOCK_P, N)
  state tile from the slot, ``state = exp(dt * A) * state + dt * x B^T``, writes it back in place and
  ``y = state @ C + D x`` (gated). Fully parallel, graph-safe.

Validation: as in ``triton_conv1d``: the reference's shape errors always (same messages, no sync), its
value errors (indices in range / distinct, ``query_start_loc`` rising from 0 to num_tokens) only with
``check_values=True`` (a host sync). Without, an index outside ``[0, num_slots)`` is never dereferenced
(the row computes from a zero state and writes no state) and token ranges are clamped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_conv1d import _check_index, _check_qsl, _next_pow2, _on
from hybridkv.layers.ops.conv1d_ref import _check_state_indices, _packed_layout
from hybridkv.layers.ops.ssd_ref import _check_ssd_params

__all__ = ["ssd_chunk_scan_triton", "ssd_state_update_triton", "ssd_launch_config"]


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) without overflow and accurate for very negative x (log1p via Goldberg's trick)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.maximum(x, 0.0) + log1p_e


@triton.jit
def _discretize(dt, dt_bias, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The reference's order: + bias, softplus, clamp (the clamp is always applied)."""
    if HAS_DT_BIAS:
        dt = dt + dt_bias
    if SOFTPLUS:
        dt = _softplus(dt)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit(do_not_specialize=["num_tokens"],      # a per-step value: one compile serves every step
            do_not_specialize_on_alignment=["qsl_ptr", "idx_ptr", "init_ptr"])
def _ssd_scan_kernel(
    y_ptr, state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_tokens, headdim, dstate, heads_per_group, num_slots, dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_yt, stride_yh, stride_yp, stride_zt, stride_zh, stride_zp,
    stride_dtt, stride_dth, stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn,
    stride_dh, stride_dp, stride_ss, stride_sh, stride_sp, stride_sn,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, N_P: tl.constexpr, D_MODE: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    req = tl.program_id(1)
    n_pb = (headdim + BLOCK_P - 1) // BLOCK_P
    h = pid // n_pb
    pb = pid % n_pb
    g = h // heads_per_group
    t0 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req).to(tl.int32), 0), num_tokens)
    t1 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req + 1).to(tl.int32), t0), num_tokens)
    seq_len = t1 - t0

    slot = tl.load(idx_ptr + req).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    if (seq_len == 0) & ~slot_ok:       # nothing to read or write (the mixed graphs' padded requests)
        return
    use_state = slot_ok & (tl.load(init_ptr + req) != 0)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < headdim
    offs_n = tl.arange(0, N_P)
    n_ok = offs_n < dstate
    s_ptrs = (state_ptr + tl.where(slot_ok, slot, 0) * stride_ss + h * stride_sh
              + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn)
    s_mask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(s_ptrs, mask=tl.where(use_state, s_mask, False), other=0.0).to(tl.float32)

    A_h = tl.load(A_ptr + h).to(tl.float32)
    dtb = 0.0
    if HAS_DT_BIAS:
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    if D_MODE == 1:
        d_skip = tl.load(D_ptr + h * stride_dh).to(tl.float32)
    elif D_MODE == 2:
        d_skip = tl.load(D_ptr + h * stride_dh + offs_p * stride_dp, mask=p_ok, other=0.0).to(tl.float32)
    else:
        d_skip = 0.0

    offs_l = tl.arange(0, CHUNK)
    causal = offs_l[:, None] >= offs_l[None, :]
    x_base = x_ptr + h * stride_xh
    b_base = B_ptr + g * stride_bg
    c_base = C_ptr + g * stride_cg
    if seq_len == 1:
        # One token (a decode, when the mixed graphs send every request through the scan): the update kernel's
        # arithmetic, in fp32, with no chunk tiles; (CHUNK, CHUNK) scores for one token cost ~3x the state's traffic.
        tok1 = t0.to(tl.int64)
        dt1 = _discretize(tl.load(dt_ptr + tok1 * stride_dtt + h * stride_dth).to(tl.float32), dtb, dt_min, dt_max,
                          HAS_DT_BIAS, SOFTPLUS)
        x1 = tl.load(x_base + tok1 * stride_xt + offs_p * stride_xp, mask=p_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_base + tok1 * stride_bt + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        cv = tl.load(c_base + tok1 * stride_ct + offs_n * stride_cn, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt1 * A_h) + (dt1 * x1)[:, None] * bv[None, :]
        y1 = tl.sum(state * cv[None, :], 1)
        if D_MODE != 0:
            y1 += d_skip * x1
        if HAS_Z:
            z1 = tl.load(z_ptr + tok1 * stride_zt + h * stride_zh + offs_p * stride_zp, mask=p_ok,
                         other=0.0).to(tl.float32)
            y1 = y1 * (z1 / (1.0 + tl.exp(-z1)))
        tl.store(y_ptr + tok1 * stride_yt + h * stride_yh + offs_p * stride_yp, y1.to(y_ptr.dtype.element_ty),
                 mask=p_ok)
    for c0 in range(0, tl.where(seq_len == 1, 0, seq_len), CHUNK):    # (a single token is done above)
        l_ok = c0 + offs_l < seq_len
        tok = (t0 + c0 + offs_l).to(tl.int64)
        dt = tl.load(dt_ptr + tok * stride_dtt + h * stride_dth, mask=l_ok, other=0.0).to(tl.float32)
        dt = tl.where(l_ok, _discretize(dt, dtb, dt_min, dt_max, HAS_DT_BIAS, SOFTPLUS), 0.0)
        a = dt * A_h
        cum = tl.cumsum(a, 0)                                      # log decay from the chunk start
        total = tl.sum(a, 0)
        xm = l_ok[:, None] & p_ok[None, :]
        x = tl.load(x_base + tok[:, None] * stride_xt + offs_p[None, :] * stride_xp, mask=xm, other=0.0)
        bt = tl.load(b_base + tok[None, :] * stride_bt + offs_n[:, None] * stride_bn,
                     mask=n_ok[:, None] & l_ok[None, :], other=0.0).to(x.dtype)     # (N_P, CHUNK): B^T
        c = tl.load(c_base + tok[:, None] * stride_ct + offs_n[None, :] * stride_cn,
                    mask=l_ok[:, None] & n_ok[None, :], other=0.0).to(x.dtype)      # (CHUNK, N_P)

        cb = tl.dot(c, bt, input_precision=PRECISION)              # (CHUNK, CHUNK) fp32
        decay = tl.exp(cum[:, None] - cum[None, :])                # inf above the diagonal: masked below
        scores = tl.where(causal, cb * decay * dt[None, :], 0.0)
        y = tl.dot(scores.to(x.dtype), x, input_precision=PRECISION)                  # intra-chunk
        y += tl.dot(c, tl.trans(state.to(x.dtype)), input_precision=PRECISION) * tl.exp(cum)[:, None]
        w = tl.exp(total - cum) * dt                               # decay from s to the chunk end, times dt
        xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)           # (CHUNK, BLOCK_P): cheaper than scaling B
        b2 = tl.load(b_base + tok[:, None] * stride_bt + offs_n[None, :] * stride_bn,          # (CHUNK, N_P)
                     mask=l_ok[:, None] & n_ok[None, :], other=0.0).to(x.dtype)     # B again: see the docstring
        state = state * tl.exp(total) + tl.dot(tl.trans(xw), b2, input_precision=PRECISION)

        if D_MODE == 1:
            y += d_skip * x.to(tl.float32)
        elif D_MODE == 2:
            y += d_skip[None, :] * x.to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + tok[:, None] * stride_zt + h * stride_zh + offs_p[None, :] * stride_zp,
                         mask=xm, other=0.0).to(tl.float32)
            y = y * (zv / (1.0 + tl.exp(-zv)))
        tl.store(y_ptr + tok[:, None] * stride_yt + h * stride_yh + offs_p[None, :] * stride_yp,
                 y.to(y_ptr.dtype.element_ty), mask=xm)

    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tl.where(slot_ok, s_mask, False))


@triton.jit
def _ssd_update_kernel(
    y_ptr, state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr,
    headdim, dstate, heads_per_group, num_slots, dt_min, dt_max,
    stride_xb, stride_xh, stride_xp, stride_yb, stride_yh, stride_yp, stride_zb, stride_zh, stride_zp,
    stride_dtb, stride_dth, stride_bb, stride_bg, stride_bn, stride_cb, stride_cg, stride_cn,
    stride_dh, stride_dp, stride_ss, stride_sh, stride_sp, stride_sn,
    BLOCK_P: tl.constexpr, N_P: tl.constexpr, D_MODE: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_pb = (headdim + BLOCK_P - 1) // BLOCK_P
    h = pid // n_pb
    pb = pid % n_pb
    g = h // heads_per_group
    slot = tl.load(idx_ptr + b).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < headdim
    offs_n = tl.arange(0, N_P)
    n_ok = offs_n < dstate
    s_ptrs = (state_ptr + tl.where(slot_ok, slot, 0) * stride_ss + h * stride_sh
              + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn)
    s_mask = p_ok[:, None] & n_ok[None, :]
    s_mask = tl.where(slot_ok, s_mask, False)                  # a bad index is never dereferenced
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)      # (BLOCK_P, N_P)

    dtb = 0.0
    if HAS_DT_BIAS:
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    dt = _discretize(tl.load(dt_ptr + b * stride_dtb + h * stride_dth).to(tl.float32), dtb, dt_min, dt_max,
                     HAS_DT_BIAS, SOFTPLUS)
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_p * stride_xp, mask=p_ok, other=0.0).to(tl.float32)
    bv = tl.load(B_ptr + b * stride_bb + g * stride_bg + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
    cv = tl.load(C_ptr + b * stride_cb + g * stride_cg + offs_n * stride_cn, mask=n_ok, other=0.0).to(tl.float32)
    state = state * dA + (dt * x)[:, None] * bv[None, :]
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    y = tl.sum(state * cv[None, :], 1)
    if D_MODE == 1:
        y += tl.load(D_ptr + h * stride_dh).to(tl.float32) * x
    elif D_MODE == 2:
        y += tl.load(D_ptr + h * stride_dh + offs_p * stride_dp, mask=p_ok, other=0.0).to(tl.float32) * x
    if HAS_Z:
        zv = tl.load(z_ptr + b * stride_zb + h * stride_zh + offs_p * stride_zp, mask=p_ok, other=0.0).to(tl.float32)
        y = y * (zv / (1.0 + tl.exp(-zv)))
    tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_p * stride_yp, y.to(y_ptr.dtype.element_ty), mask=p_ok)


# --------------------------------------------------------------------------------------------- host side

def ssd_launch_config(*, headdim: int, dstate: int, decode: bool) -> dict[str, int]:
    """Tile shapes, the best of an H100 sweep (Codestral-like: 128 heads x 64 x state 128, 8 groups, bf16;
    every config checked against the reference first).

    Scan: per program CHUNK x N_P tiles of B and C, a (BLOCK_P, N_P) fp32 state and (CHUNK, CHUNK) scores;
    every dot dimension is a power of two >= 16 (tl.dot's minimum). 32-token chunks x 32 channels x 4 warps
    ran 1 x 4096 tokens in 285 µs; the next best were 457 µs (32 x 64) and 731 µs (64 x 32, the first
    guess); larger tiles spill registers. N = 256 (not swept): half the channels. Decode: a (BLOCK_P, N_P)
    tile per program; 16 channels x 4 warps was within 2% of the best at batch 1 and 32."""
    n_p = max(16, _next_pow2(dstate))
    if decode:
        return {"BLOCK_P": max(4, min(16, _next_pow2(headdim))), "num_warps": 4 if n_p >= 128 else 2}
    return {"CHUNK": 32, "BLOCK_P": max(16, min(32 if n_p <= 128 else 16, _next_pow2(headdim))),
            "num_warps": 4, "num_stages": 2}


def _d_mode(D: torch.Tensor | None) -> int:
    return 0 if D is None else D.dim()


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _check_devices(x: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: the kernel needs one device")


def _limits(dt_limit: tuple[float, float]) -> tuple[float, float]:
    lo, hi = (float(v) for v in dt_limit)
    return lo, hi


def ssd_chunk_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``ssd_chunk_scan_ref`` (any strides on every input). ``chunk_size`` is validated
    like the reference's but the kernel blocks by its own ``CHUNK`` (see the module docstring).
    ``out``: optional (num_tokens, nheads, headdim) destination; ``check_values``: also run the
    reference's value checks (host sync)."""
    heads_per_group = _check_ssd_params(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_reqs = _check_qsl(query_start_loc)
    _check_index("state_indices", state_indices, num_reqs)
    _check_index("has_initial_state", has_initial_state, num_reqs)
    num_tokens, nheads, headdim = x.shape
    if check_values:
        _packed_layout(num_tokens, query_start_loc, state_indices, has_initial_state, ssm_states.shape[0],
                       x.device)
    _check_devices(x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    dstate = ssm_states.shape[-1]
    if num_reqs == 0 or nheads == 0 or headdim == 0:
        return out
    cfg = ssd_launch_config(headdim=headdim, dstate=dstate, decode=False)
    dev = x.device
    qsl, idx = _on(query_start_loc, dev), _on(state_indices, dev)
    init = _on(has_initial_state, dev).view(torch.uint8)
    lo, hi = _limits(dt_limit)
    n_pb = triton.cdiv(headdim, cfg["BLOCK_P"])
    d_strides = (D.stride(0), D.stride(1) if D.dim() == 2 else 0) if D is not None else (0, 0)
    _ssd_scan_kernel[(nheads * n_pb, num_reqs)](
        out, ssm_states, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, qsl, idx, init,
        num_tokens, headdim, dstate, heads_per_group, ssm_states.shape[0], lo, hi,
        *x.stride(), *out.stride(), *_strides(z, 3), *dt.stride(), *B.stride(), *C.stride(), *d_strides,
        *ssm_states.stride(),
        CHUNK=cfg["CHUNK"], BLOCK_P=cfg["BLOCK_P"], N_P=max(16, _next_pow2(dstate)), D_MODE=_d_mode(D),
        HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(out.device),
    )
    return out


def ssd_state_update_triton(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``ssd_state_update_ref``: one launch, grid from shapes only (CUDA-graph
    capturable), state slots updated in place. ``out`` / ``check_values`` as in ``ssd_chunk_scan_triton``."""
    heads_per_group = _check_ssd_params(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    batch, nheads, headdim = x.shape
    if check_values:
        _check_state_indices(state_indices, batch, ssm_states.shape[0])
    else:
        _check_index("state_indices", state_indices, batch)
    _check_devices(x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    if batch == 0 or nheads == 0 or headdim == 0:
        return out
    dstate = ssm_states.shape[-1]
    cfg = ssd_launch_config(headdim=headdim, dstate=dstate, decode=True)
    idx = _on(state_indices, x.device)
    lo, hi = _limits(dt_limit)
    n_pb = triton.cdiv(headdim, cfg["BLOCK_P"])
    d_strides = (D.stride(0), D.stride(1) if D.dim() == 2 else 0) if D is not None else (0, 0)
    _ssd_update_kernel[(nheads * n_pb, batch)](
        out, ssm_states, x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, idx,
        headdim, dstate, heads_per_group, ssm_states.shape[0], lo, hi,
        *x.stride(), *out.stride(), *_strides(z, 3), *dt.stride(), *B.stride(), *C.stride(), *d_strides,
        *ssm_states.stride(),
        BLOCK_P=cfg["BLOCK_P"], N_P=max(16, _next_pow2(dstate)), D_MODE=_d_mode(D),
        HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        num_warps=cfg["num_warps"], **pdl_kwargs(out.device),
    )
    return out

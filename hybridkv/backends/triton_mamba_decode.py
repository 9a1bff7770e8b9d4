"""A Mamba2 layer's whole decode step between in_proj and out_proj in ONE Triton launch: the causal conv
update (silu), the SSD state update and the gated RMS norm, which the mixer otherwise runs as three kernels
(``causal_conv1d_update`` -> ``ssd_state_update`` -> ``gated_rms_norm``). At decode batch sizes a step is
made of such launches, so their number, not their bytes, sets the step time.

Same contract as ``mamba2_decode_ref`` (``hybridkv.layers.ops.mamba2_decode_ref``), checked against it in
tests/test_triton_mamba_decode.py, with the three-op composition's rounding points: the conv output is
rounded to xbc's dtype before the SSD reads it, y to xbc's dtype before the norm.

Kernel design: grid = (heads x P-blocks, tokens), one program per (token, head, ``BLOCK_P`` head channels),
as ``_ssd_update_kernel``.

- The program convolves its own x channels and its group's B and C channels from the conv state (B/C is
  repeated by every program of the group: 2 x dstate channels), then updates its (BLOCK_P, dstate) SSM
  state tile and stores its y (un-normed, into the output buffer) before the arrival below. It owns its x
  channels' conv state and shifts it in place after the arrival (loads, barrier, stores).
- The B/C conv state of a (token, group) is read by every program of the group, so it may be shifted only
  once all of them have read it: each program passes a barrier and increments the (token, group) arrival
  counter (acq_rel); the LAST arrival shifts the B/C state and runs the gated RMS norm over the group's
  channels (norm groups are the SSD groups), reading the others' y with ``.cg`` loads (written on other
  SMs), then re-zeroes the counter, so the next launch and CUDA-graph replays start from zero. Without a
  norm each program gates its own y.
- A padding row (negative slot, or one past the pool) reads and writes no state: it computes from zeros,
  and its programs still arrive, so no counter is left behind.

Measured on an H100 (CUDA graph, Codestral-like 128 heads x 64, 8 groups, state 128, bf16, against the three
Triton kernels with PDL): outputs and states bit-equal to theirs; 5.9 µs at 1 token, the same as the three
(5.9); SLOWER from 4 tokens: 12.5 vs 11.3 µs at 4, 118 vs 101 at 32, 458 vs 382 at 128. The state stream is
the same bytes, but every program repeats its group's B/C conv and holds its registers through the arrival,
so fewer bytes are in flight. Whoever routes calls here should measure the whole step first.

The counters are allocated once per device (``_counters``); two launches running at once on different
streams of one device would share them (not supported, as for ``triton_linear``). Grid from shapes only,
no host sync, no allocation but the output: CUDA-graph capturable. Shape errors as the references raise
them; value checks (indices distinct) are the caller's: duplicate slots race.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_conv1d import _check_common, _check_index, _next_pow2, _on, _silu
from hybridkv.backends.triton_ssd import _check_devices, _d_mode, _discretize, _limits
from hybridkv.layers.ops.conv1d_ref import _check_shape
from hybridkv.layers.ops.mamba2_decode_ref import mamba2_decode_out_dtype
from hybridkv.layers.ops.ssd_ref import _check_ssd_params

__all__ = ["mamba2_decode_launch_config", "mamba2_decode_triton"]

_MAX_COUNTERS = 1 << 16             # (token, group) arrival counters per device
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters, allocated once per device (each group's last program re-zeroes its own,
    so a captured graph can replay them)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton.jit
def _conv_step(x_row, s_base, w_ptr, b_ptr, ch, ok, slot_ok, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk,
               stride_b, HIST: tl.constexpr, HIST_P: tl.constexpr, HAS_BIAS: tl.constexpr):
    """silu(causal depthwise conv) of channels ``ch`` (BLOCK,) at one token, fp32 as ``_conv1d_update_kernel``
    sums it, and the raw inputs (the state's new last column). No state is read unless ``slot_ok``."""
    xv = tl.load(x_row + ch * stride_xc, mask=ok, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w_ptr + ch * stride_wc + HIST * stride_wk, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch * stride_b, mask=ok, other=0.0).to(tl.float32)
    offs_j = tl.arange(0, HIST_P)
    m = ok[:, None] & (offs_j < HIST)[None, :]
    old = tl.load(s_base + ch[:, None] * stride_sc + offs_j[None, :] * stride_sk, mask=tl.where(slot_ok, m, False),
                  other=0.0).to(tl.float32)                                   # (BLOCK, HIST_P)
    w = tl.load(w_ptr + ch[:, None] * stride_wc + offs_j[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32)
    return _silu(acc + tl.sum(old * w, 1)), xv


@triton.jit
def _shift_conv_state(s_base, ch, ok, slot_ok, xv, stride_sc, stride_sk, HIST: tl.constexpr, HIST_P: tl.constexpr):
    """Conv state of channels ``ch`` <- its columns 1.. ++ the new input xv, in place (loads, barrier, stores);
    nothing for a padding row."""
    offs_j = tl.arange(0, HIST_P)
    m = tl.where(slot_ok, ok[:, None] & (offs_j < HIST)[None, :], False)
    ptrs = s_base + ch[:, None] * stride_sc + offs_j[None, :] * stride_sk    # (BLOCK, HIST_P)
    nxt = tl.load(ptrs + stride_sk, mask=m & (offs_j + 1 < HIST)[None, :], other=0.0)
    nxt = tl.where((offs_j == HIST - 1)[None, :], xv[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()                                                        # every read of the slot done
    tl.store(ptrs, nxt, mask=m)


@triton.jit
def _gated(y, z, NORM_BEFORE_GATE: tl.constexpr):
    """The values whose RMS is taken: y, or y * silu(z) (the default, norm after the gate)."""
    if NORM_BEFORE_GATE:
        return y
    return y * _silu(z)


@triton.jit
def _normed(y, z, w, inv, X_TY: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """``gated_rms_norm_ref``'s output given 1 / rms: w * normed(y) * silu(z) in fp32, or normed(y * silu(z))
    rounded to y's dtype, then times w."""
    if NORM_BEFORE_GATE:
        return w * (y * inv) * _silu(z)
    return (y * _silu(z) * inv).to(X_TY).to(tl.float32) * w


@triton.jit
def _group_norm(o_row, z_row, w_ptr, c0, gsize, eps, stride_zc, stride_w,
                X_TY: tl.constexpr, BLOCK_G: tl.constexpr, ONE_PASS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """The gated RMS norm of channels [c0, c0 + gsize) of one row, in place in ``o_row``, which holds the group's
    y (rounded to X_TY) stored by the group's programs: ``.cg`` loads (other SMs wrote them). ONE_PASS (the
    group fits in BLOCK_G): one round of loads; else two passes of BLOCK_G channels (sum of squares, scale)."""
    lanes = tl.arange(0, BLOCK_G)
    if ONE_PASS:
        m = lanes < gsize
        y = tl.load(o_row + c0 + lanes, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        z = tl.load(z_row + (c0 + lanes) * stride_zc, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + (c0 + lanes) * stride_w, mask=m, other=0.0).to(tl.float32)
        v = _gated(y, z, NORM_BEFORE_GATE)
        inv = 1.0 / tl.sqrt(tl.sum(v * v, 0) / gsize + eps)
        tl.store(o_row + c0 + lanes, _normed(y, z, w, inv, X_TY, NORM_BEFORE_GATE).to(o_row.dtype.element_ty),
                 mask=m)
    else:
        sq = tl.zeros([BLOCK_G], tl.float32)
        for k in range(0, gsize, BLOCK_G):
            m = k + lanes < gsize
            y = tl.load(o_row + c0 + k + lanes, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            z = tl.load(z_row + (c0 + k + lanes) * stride_zc, mask=m, other=0.0).to(tl.float32)
            v = _gated(y, z, NORM_BEFORE_GATE)
            sq += v * v
        inv = 1.0 / tl.sqrt(tl.sum(sq, 0) / gsize + eps)
        for k in range(0, gsize, BLOCK_G):
            m = k + lanes < gsize
            y = tl.load(o_row + c0 + k + lanes, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            z = tl.load(z_row + (c0 + k + lanes) * stride_zc, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + (c0 + k + lanes) * stride_w, mask=m, other=0.0).to(tl.float32)
            tl.store(o_row + c0 + k + lanes, _normed(y, z, w, inv, X_TY, NORM_BEFORE_GATE).to(o_row.dtype.element_ty),
                     mask=m)


@triton.jit
def _mamba2_decode_kernel(
    out_ptr, xbc_ptr, z_ptr, dt_ptr, cs_ptr, cw_ptr, cb_ptr, ss_ptr, A_ptr, D_ptr, dtb_ptr, nw_ptr, idx_ptr,
    count_ptr,
    headdim, dstate, heads_per_group, n_groups, num_slots, dt_min, dt_max, eps,
    stride_xt, stride_xc, stride_zt, stride_zc, stride_dtt, stride_dth, stride_ot,
    stride_cs, stride_cc, stride_ck, stride_wc, stride_wk, stride_b, stride_nw, stride_dh, stride_dp,
    stride_ss, stride_sh, stride_sp, stride_sn,
    HIST: tl.constexpr, HIST_P: tl.constexpr, BLOCK_P: tl.constexpr, N_P: tl.constexpr, BLOCK_G: tl.constexpr,
    ONE_PASS: tl.constexpr, D_MODE: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_NORM: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_pb = (headdim + BLOCK_P - 1) // BLOCK_P
    h = pid // n_pb
    pb = pid % n_pb
    g = h // heads_per_group
    gsize = heads_per_group * headdim                   # channels of a norm group = an SSD group's heads
    d_inner = n_groups * gsize
    x_ty = xbc_ptr.dtype.element_ty
    slot = tl.load(idx_ptr + b).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    safe = tl.where(slot_ok, slot, 0)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < headdim
    offs_n = tl.arange(0, N_P)
    n_ok = offs_n < dstate

    # conv of this program's x channels (it owns their state) and of its group's B and C (every program of
    # the group reads their state: the last one shifts it)
    x_row = xbc_ptr + b * stride_xt
    cs_base = cs_ptr + safe * stride_cs
    ch_x = h * headdim + offs_p
    ch_b = d_inner + g * dstate + offs_n
    ch_c = ch_b + n_groups * dstate
    x, x_in = _conv_step(x_row, cs_base, cw_ptr, cb_ptr, ch_x, p_ok, slot_ok, stride_xc, stride_cc, stride_ck,
                         stride_wc, stride_wk, stride_b, HIST, HIST_P, HAS_CONV_BIAS)
    bv, b_in = _conv_step(x_row, cs_base, cw_ptr, cb_ptr, ch_b, n_ok, slot_ok, stride_xc, stride_cc, stride_ck,
                          stride_wc, stride_wk, stride_b, HIST, HIST_P, HAS_CONV_BIAS)
    cv, c_in = _conv_step(x_row, cs_base, cw_ptr, cb_ptr, ch_c, n_ok, slot_ok, stride_xc, stride_cc, stride_ck,
                          stride_wc, stride_wk, stride_b, HIST, HIST_P, HAS_CONV_BIAS)
    x = x.to(x_ty).to(tl.float32)                       # causal_conv1d_update's output dtype
    bv = bv.to(x_ty).to(tl.float32)
    cv = cv.to(x_ty).to(tl.float32)

    # SSD state update of the (BLOCK_P, N_P) tile, as _ssd_update_kernel
    s_ptrs = (ss_ptr + safe * stride_ss + h * stride_sh
              + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn)
    s_mask = tl.where(slot_ok, p_ok[:, None] & n_ok[None, :], False)
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    dtb = 0.0
    if HAS_DT_BIAS:
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
    dt = _discretize(tl.load(dt_ptr + b * stride_dtt + h * stride_dth).to(tl.float32), dtb, dt_min, dt_max,
                     HAS_DT_BIAS, SOFTPLUS)
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    state = state * dA + (dt * x)[:, None] * bv[None, :]
    tl.store(s_ptrs, state.to(ss_ptr.dtype.element_ty), mask=s_mask)
    y = tl.sum(state * cv[None, :], 1)
    if D_MODE == 1:
        y += tl.load(D_ptr + h * stride_dh).to(tl.float32) * x
    elif D_MODE == 2:
        y += tl.load(D_ptr + h * stride_dh + offs_p * stride_dp, mask=p_ok, other=0.0).to(tl.float32) * x
    y = y.to(x_ty).to(tl.float32)                       # ssd_state_update's output dtype
    o_row = out_ptr + b * stride_ot
    z_row = z_ptr + b * stride_zt
    if HAS_NORM:  # noqa: SIM108  (constexpr branch)    # un-normed y: the group's last program norms it
        out = y
    else:
        out = y * _silu(tl.load(z_row + ch_x * stride_zc, mask=p_ok, other=0.0).to(tl.float32))

    tl.store(o_row + ch_x, out.to(out_ptr.dtype.element_ty), mask=p_ok)
    tl.debug_barrier()                                  # every thread's conv-state reads and y stores done
    counter = count_ptr + b * n_groups + g
    last = tl.atomic_add(counter, 1, sem="acq_rel") == heads_per_group * n_pb - 1
    _shift_conv_state(cs_base, ch_x, p_ok, slot_ok, x_in, stride_cc, stride_ck, HIST, HIST_P)   # owned channels
    if last:
        _shift_conv_state(cs_base, ch_b, n_ok, slot_ok, b_in, stride_cc, stride_ck, HIST, HIST_P)
        _shift_conv_state(cs_base, ch_c, n_ok, slot_ok, c_in, stride_cc, stride_ck, HIST, HIST_P)
        if HAS_NORM:
            _group_norm(o_row, z_row, nw_ptr, g * gsize, gsize, eps, stride_zc, stride_nw, x_ty, BLOCK_G, ONE_PASS,
                        NORM_BEFORE_GATE)
        tl.store(counter, 0)                            # ready for the next launch (or graph replay)


# --------------------------------------------------------------------------------------------- host side

def mamba2_decode_launch_config(*, headdim: int, dstate: int, group_size: int) -> dict[str, int]:
    """Tiles from a sweep on an H100 (Codestral-like: 128 heads x 64, 8 groups, state 128, bf16, in a CUDA
    graph, 1-128 tokens; the script was not committed): a whole head per program, up to 8192 fp32 state
    entries (64 x 128, 8 warps). Every program repeats its group's B/C conv, so smaller tiles repeat it more:
    ``_ssd_update_kernel``'s 16 x 128 tile took 161 vs 115 µs at 32 tokens. The norm: a whole group up to
    2048 channels in one round of loads, else passes of 1024."""
    n_p = max(16, _next_pow2(dstate))
    block_p = max(4, min(_next_pow2(headdim), 8192 // n_p))
    block_g = _next_pow2(group_size)
    return {"BLOCK_P": block_p, "num_warps": 8 if block_p * n_p >= 8192 else 4,
            "BLOCK_G": block_g if block_g <= 2048 else 1024}


def mamba2_decode_triton(
    xbc: torch.Tensor,
    z: torch.Tensor,
    dt: torch.Tensor,
    *,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    A: torch.Tensor,
    state_indices: torch.Tensor,
    n_groups: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    norm_before_gate: bool = False,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Same contract as ``mamba2_decode_ref`` (any strides on xbc, z, dt, the state pools and the weights), in
    one launch. ``n_groups`` is both the B/C groups and the norm's: a caller whose norm groups differ (a group
    cut across tensor-parallel ranks) keeps the three-op path. ``config``: overrides of
    ``mamba2_decode_launch_config``."""
    width = _check_common(xbc, conv_weight, conv_bias, conv_states)
    if width < 2:
        raise ValueError(f"mamba2_decode: conv width must be >= 2, got {width}")
    _check_shape("ssm_states", ssm_states, (None, None, None, None))
    num_slots, heads, headdim, dstate = ssm_states.shape
    num_tokens, conv_dim = xbc.shape
    d_inner, gs = heads * headdim, n_groups * dstate
    if n_groups < 1 or conv_dim != d_inner + 2 * gs:
        raise ValueError(f"mamba2_decode: xbc has {conv_dim} channels, expected x | B | C = {d_inner} + 2 x "
                         f"{n_groups} groups x {dstate} (ssm_states {tuple(ssm_states.shape)}, n_groups {n_groups})")
    xs, B, C = xbc.split([d_inner, gs, gs], dim=1)
    _check_ssd_params(xs.unflatten(1, (heads, headdim)), dt, A, B.unflatten(1, (n_groups, dstate)),
                      C.unflatten(1, (n_groups, dstate)), D, None, dt_bias, ssm_states)
    _check_shape("z", z, (num_tokens, d_inner))
    if norm_weight is not None:
        _check_shape("norm_weight", norm_weight, (d_inner,))
    _check_index("state_indices", state_indices, num_tokens)
    _check_devices(xbc, z=z, dt=dt, A=A, D=D, dt_bias=dt_bias, ssm_states=ssm_states, norm_weight=norm_weight)
    if num_tokens * n_groups > _MAX_COUNTERS:
        raise ValueError(f"mamba2_decode: {num_tokens} tokens x {n_groups} groups exceed the {_MAX_COUNTERS} "
                         "arrival counters")
    out = torch.empty(num_tokens, d_inner, dtype=mamba2_decode_out_dtype(xbc, norm_weight, norm_before_gate),
                      device=xbc.device)
    if num_tokens == 0 or d_inner == 0:
        return out
    gsize = d_inner // n_groups
    cfg = mamba2_decode_launch_config(headdim=headdim, dstate=dstate, group_size=gsize)
    if config:
        cfg.update(config)
    n_pb = triton.cdiv(headdim, cfg["BLOCK_P"])
    d_strides = (D.stride(0), D.stride(1) if D.dim() == 2 else 0) if D is not None else (0, 0)
    _mamba2_decode_kernel[(heads * n_pb, num_tokens)](
        out, xbc, z, dt, conv_states, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        ssm_states, A, D if D is not None else A, dt_bias if dt_bias is not None else A,
        norm_weight if norm_weight is not None else A, _on(state_indices, xbc.device), _counters(xbc.device),
        headdim, dstate, heads // n_groups, n_groups, num_slots, *_limits(dt_limit), float(norm_eps),
        *xbc.stride(), *z.stride(), *dt.stride(), out.stride(0), *conv_states.stride(), *conv_weight.stride(),
        conv_bias.stride(0) if conv_bias is not None else 0, norm_weight.stride(0) if norm_weight is not None else 0,
        *d_strides, *ssm_states.stride(),
        HIST=width - 1, HIST_P=max(2, _next_pow2(width - 1)), BLOCK_P=cfg["BLOCK_P"],
        N_P=max(16, _next_pow2(dstate)), BLOCK_G=cfg["BLOCK_G"], ONE_PASS=gsize <= cfg["BLOCK_G"],
        D_MODE=_d_mode(D), HAS_CONV_BIAS=conv_bias is not None, HAS_DT_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus), HAS_NORM=norm_weight is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
        num_warps=cfg["num_warps"], **pdl_kwargs(out.device),
    )
    return out

"""Triton causal depthwise conv1d over packed requests with per-request state slots (+ the decode step).

Signatures are those of the references ``causal_conv1d_ref`` / ``causal_conv1d_update_ref``
(``hybridkv.layers.ops.conv1d_ref``) plus optional keyword arguments, so the ``triton`` backend is a
drop-in replacement checked against them (tests/test_triton_mamba.py).

Kernel design:

- ``_conv1d_varlen_kernel`` (prefill, chunked prefill, any packed mix): grid = (token blocks, channel
  blocks). A token block is ``BLOCK_T`` consecutive tokens of ONE request, aligned to the request's first
  token; request r owns token blocks ``qsl[r] // BLOCK_T + r ..`` (the monotone index of
  ``triton_attention``, found by its ``find_request`` over ``query_start_loc`` in the kernel), so the grid
  depends on (num_tokens, num_reqs) only: no host work per request, no device->host sync, graph-safe.
  Each output is ``sum_k w[:, k] * in[t - width + 1 + k]`` in fp32, where inputs before the request's first
  token come from its state slot (``has_initial_state``) or are zeros (the slot is then never read).
- the final state (last ``width - 1`` inputs of old state ++ new tokens) is written by the program of the
  request's FIRST token block, the only program that reads the old state (``BLOCK_T >= width - 1``): it
  loads everything it needs, passes a barrier, then overwrites the slot, so no other program can see a
  half-written slot. A request with zero tokens still gets that program: its slot ends up holding its
  initial state (zeros without one), as in the reference.
- ``_conv1d_update_kernel`` (decode): grid = (channel blocks, batch); the program loads its slot's
  (BLOCK_D, width - 1) window, computes the output, and stores the window shifted by one with the new
  input appended (loads, barrier, store: in place without a race).

Validation: shapes and dtypes are checked exactly like the reference (same ValueError messages, no
device->host sync). The reference's VALUE checks (indices in range and distinct, ``query_start_loc``
rising from 0 to num_tokens) read device values, i.e. a host sync, so they run only with
``check_values=True``; without them an index outside ``[0, num_slots)`` is never dereferenced (that row's
state is neither read nor written: it computes from a zero state) and token ranges are clamped to
``[0, num_tokens]``, so bad metadata cannot corrupt memory. Duplicate indices race (undefined result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_attention import find_request
from hybridkv.layers.ops.conv1d_ref import (
    _check_activation,
    _check_shape,
    _check_state_indices,
    _packed_layout,
)

__all__ = ["causal_conv1d_triton", "causal_conv1d_update_triton", "conv1d_launch_config"]


@triton.jit
def _silu(y):
    return y / (1.0 + tl.exp(-y))


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"],      # per-step values: one compile serves all
            do_not_specialize_on_alignment=["qsl_ptr", "idx_ptr", "init_ptr"])
def _conv1d_varlen_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    num_reqs, num_tokens, dim, num_slots,
    stride_xt, stride_xd, stride_yt, stride_yd, stride_wd, stride_wk,
    stride_ss, stride_sd, stride_sk,
    WIDTH: tl.constexpr, HIST: tl.constexpr, HIST_P: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    req = find_request(qsl_ptr, num_reqs, pid, BLOCK_T)
    t0 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req).to(tl.int32), 0), num_tokens)
    t1 = tl.minimum(tl.maximum(tl.load(qsl_ptr + req + 1).to(tl.int32), t0), num_tokens)
    seq_len = t1 - t0
    t_blk = pid - (tl.load(qsl_ptr + req).to(tl.int32) // BLOCK_T + req)
    slot = tl.load(idx_ptr + req).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    if (t_blk * BLOCK_T >= seq_len) & ((t_blk > 0) | ~slot_ok):   # past the request (block 0 writes its state,
        return                                                     # if it has a slot: padded requests have none)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    offs_t = t_blk * BLOCK_T + tl.arange(0, BLOCK_T)          # positions inside the request
    t_ok = offs_t < seq_len

    use_state = slot_ok & (tl.load(init_ptr + req) != 0)
    s_base = state_ptr + tl.where(slot_ok, slot, 0) * stride_ss
    x_base = x_ptr + t0.to(tl.int64) * stride_xt

    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for k in tl.static_range(WIDTH):
        w = tl.load(w_ptr + offs_d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
        pos = offs_t - HIST + k                                 # input position this tap reads
        from_x = t_ok & (pos >= 0)
        v = tl.load(x_base + pos.to(tl.int64)[:, None] * stride_xt + offs_d[None, :] * stride_xd,
                    mask=from_x[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HIST > 0:                                            # taps before the request: its slot
            from_s = tl.where(use_state, t_ok & (pos < 0), False)  # (only in the first block)
            col = tl.where(pos < 0, pos + HIST, 0)
            v += tl.load(s_base + offs_d[None, :] * stride_sd + col[:, None] * stride_sk,
                         mask=from_s[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += v * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + (t0 + offs_t).to(tl.int64)[:, None] * stride_yt + offs_d[None, :] * stride_yd,
             acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])

    if HIST > 0:  # noqa: SIM102  (a compile-time test around a run-time one)
        if t_blk == 0:
            # new state column j = input at position seq_len - HIST + j of (old state ++ tokens)
            # (fresh names: a run-time `if` may not redefine a variable with another shape)
            offs_j = tl.arange(0, HIST_P)
            j_ok = offs_j < HIST
            npos = seq_len - HIST + offs_j
            nx_ok = j_ok & (npos >= 0)
            nv = tl.load(x_base + npos.to(tl.int64)[None, :] * stride_xt + offs_d[:, None] * stride_xd,
                         mask=nx_ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            ncol = tl.where(npos < 0, npos + HIST, 0)
            ns_ok = tl.where(use_state, j_ok & (npos < 0), False)
            nv += tl.load(s_base + offs_d[:, None] * stride_sd + ncol[None, :] * stride_sk,
                          mask=ns_ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            tl.debug_barrier()                                  # every read of the old slot is done
            s_mask = tl.where(slot_ok, j_ok[None, :] & d_ok[:, None], False)
            tl.store(s_base + offs_d[:, None] * stride_sd + offs_j[None, :] * stride_sk,
                     nv.to(state_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _conv1d_update_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, state_ptr, idx_ptr,
    dim, num_slots,
    stride_xb, stride_xd, stride_yb, stride_yd, stride_wd, stride_wk,
    stride_ss, stride_sd, stride_sk,
    WIDTH: tl.constexpr, HIST: tl.constexpr, HIST_P: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    slot = tl.load(idx_ptr + b).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    s_base = state_ptr + tl.where(slot_ok, slot, 0) * stride_ss

    xv = tl.load(x_ptr + b * stride_xb + offs_d * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
    acc = xv * tl.load(w_ptr + offs_d * stride_wd + HIST * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if HIST > 0:
        offs_j = tl.arange(0, HIST_P)
        j_ok = offs_j < HIST
        m = tl.where(slot_ok, d_ok[:, None] & j_ok[None, :], False)
        old = tl.load(s_base + offs_d[:, None] * stride_sd + offs_j[None, :] * stride_sk, mask=m,
                      other=0.0).to(tl.float32)                               # (BLOCK_D, HIST_P)
        w = tl.load(w_ptr + offs_d[:, None] * stride_wd + offs_j[None, :] * stride_wk,
                    mask=d_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(old * w, 1)
        # shifted window: column j <- column j + 1, last column <- x
        nxt = tl.load(s_base + offs_d[:, None] * stride_sd + (offs_j + 1)[None, :] * stride_sk,
                      mask=m & (offs_j + 1 < HIST)[None, :], other=0.0)
        nxt = tl.where((offs_j == HIST - 1)[None, :], xv[:, None].to(nxt.dtype), nxt)
        tl.debug_barrier()                                                    # all reads of the slot done
        tl.store(s_base + offs_d[:, None] * stride_sd + offs_j[None, :] * stride_sk,
                 nxt.to(state_ptr.dtype.element_ty), mask=m)
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + b * stride_yb + offs_d * stride_yd, acc.to(y_ptr.dtype.element_ty), mask=d_ok)


# --------------------------------------------------------------------------------------------- host side

def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def conv1d_launch_config(*, width: int, decode: bool) -> dict[str, int]:
    """Tile shapes, the best of an H100 sweep (Codestral-like conv_dim 10240, width 4). Prefill: 16 tokens x
    64 channels per program, 2 warps (158 µs vs 192 µs for 32 x 128 x 4 warps at 1 x 4096 tokens); each
    input is loaded ``width`` times, from L1 after the first; the token block is at least ``width - 1`` (the
    first block must hold every tap that reaches into the state). Decode: 128 channels, 4 warps (within 0.1 µs
    of the best at batch 1 and 32)."""
    if decode:
        return {"BLOCK_D": 128, "num_warps": 4}
    return {"BLOCK_T": max(16, _next_pow2(width)), "BLOCK_D": 64, "num_warps": 2}


def _check_common(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_states: torch.Tensor) -> int:
    """The reference's shape checks (same messages); returns width."""
    _check_shape("x", x, (None, None))
    dim = x.shape[1]
    _check_shape("weight", weight, (dim, None))
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight must have width >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        _check_shape("bias", bias, (dim,))
    _check_shape("conv_states", conv_states, (None, dim, width - 1))
    for name, t in (("weight", weight), ("bias", bias), ("conv_states", conv_states)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: the kernel needs one device")
    return width


def _check_index(name: str, t: torch.Tensor, n: int) -> None:
    """Shape and dtype of an index / flag tensor, as the reference checks them (no value reads)."""
    _check_shape(name, t, (n,))
    if name == "has_initial_state":
        if t.dtype != torch.bool:
            raise ValueError(f"has_initial_state must be a bool tensor, got {t.dtype}")
    elif t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_qsl(query_start_loc: torch.Tensor) -> int:
    """1-D integer (num_reqs + 1,); returns num_reqs."""
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(
            f"query_start_loc must be 1-D (num_reqs + 1,), got shape {tuple(query_start_loc.shape)}"
        )
    if query_start_loc.is_floating_point() or query_start_loc.dtype == torch.bool:
        raise ValueError(f"query_start_loc must be an integer tensor, got {query_start_loc.dtype}")
    return query_start_loc.numel() - 1


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``causal_conv1d_ref``: x (num_tokens, dim), any strides; weight (dim, width);
    bias (dim,) or None; conv_states (num_slots, dim, width - 1), any strides, updated in place at
    ``state_indices`` with each request's last width - 1 inputs. Returns y (num_tokens, dim) in x's dtype.

    ``out``: optional (num_tokens, dim) destination; ``check_values``: also run the reference's value
    checks (a host sync; see the module docstring)."""
    _check_activation(activation)
    width = _check_common(x, weight, bias, conv_states)
    num_reqs = _check_qsl(query_start_loc)
    _check_index("state_indices", state_indices, num_reqs)
    _check_index("has_initial_state", has_initial_state, num_reqs)
    num_tokens, dim = x.shape
    if check_values:
        _packed_layout(num_tokens, query_start_loc, state_indices, has_initial_state, conv_states.shape[0],
                       x.device)
    if out is None:
        out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    if num_reqs == 0 or dim == 0:
        return out
    cfg = conv1d_launch_config(width=width, decode=False)
    if cfg["BLOCK_T"] < width - 1:        # the first token block must hold every tap into the state
        raise ValueError(f"conv1d launch: BLOCK_T {cfg['BLOCK_T']} must be >= width - 1 = {width - 1}")
    dev = x.device
    qsl, idx = _on(query_start_loc, dev), _on(state_indices, dev)
    init = _on(has_initial_state, dev).view(torch.uint8)
    grid = (num_tokens // cfg["BLOCK_T"] + num_reqs, triton.cdiv(dim, cfg["BLOCK_D"]))
    _conv1d_varlen_kernel[grid](
        out, x, weight, bias if bias is not None else weight, conv_states, qsl, idx, init,
        num_reqs, num_tokens, dim, conv_states.shape[0],
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        WIDTH=width, HIST=width - 1, HIST_P=max(2, _next_pow2(width - 1)), BLOCK_T=cfg["BLOCK_T"],
        BLOCK_D=cfg["BLOCK_D"],
        HAS_BIAS=bias is not None, SILU=activation is not None, num_warps=cfg["num_warps"], **pdl_kwargs(out.device),
    )
    return out


def causal_conv1d_update_triton(
    x: torch.Tensor,
    *,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    check_values: bool = False,
) -> torch.Tensor:
    """Same contract as ``causal_conv1d_update_ref``: x (batch, dim), any strides; conv_states
    (num_slots, dim, width - 1) updated in place at ``state_indices`` (batch,). Returns y (batch, dim).
    One launch, grid from shapes only (CUDA-graph capturable). ``out`` / ``check_values`` as in
    ``causal_conv1d_triton``."""
    _check_activation(activation)
    width = _check_common(x, weight, bias, conv_states)
    batch, dim = x.shape
    if check_values:
        _check_state_indices(state_indices, batch, conv_states.shape[0])
    else:
        _check_index("state_indices", state_indices, batch)
    if out is None:
        out = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
    if batch == 0 or dim == 0:
        return out
    cfg = conv1d_launch_config(width=width, decode=True)
    idx = _on(state_indices, x.device)
    grid = (triton.cdiv(dim, cfg["BLOCK_D"]), batch)
    _conv1d_update_kernel[grid](
        out, x, weight, bias if bias is not None else weight, conv_states, idx,
        dim, conv_states.shape[0],
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        WIDTH=width, HIST=width - 1, HIST_P=max(2, _next_pow2(width - 1)), BLOCK_D=cfg["BLOCK_D"],
        HAS_BIAS=bias is not None, SILU=activation is not None, num_warps=cfg["num_warps"], **pdl_kwargs(out.device),
    )
    return out

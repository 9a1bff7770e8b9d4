"""Routed experts for decode-sized batches as two Triton GEMV kernels (``layers/moe.py`` impl "gemv").

With a handful of (token, slot) assignments, a grouped GEMM spends its time on tile setup and reads the
weights at a fraction of the memory bandwidth; a GEMV per assignment that reads only its expert's rows is
bandwidth-bound, which is the best a decode step can do. Each assignment reads its expert's weights once,
so the kernels only pay off while assignments rarely share an expert (``layers.moe.GEMV_MAX_ROWS``).

- ``_gate_up_kernel``: grid (assignments, inter blocks): ``h = act(gate_e x) * up_e x`` for BLOCK_N output
  channels, x scaled by the routing weight first for Llama-4 (``scale_input``), rounded where the reference
  rounds (x, gate, up, act, h in the model dtype; fp32 accumulation).
- ``_down_kernel``: grid (assignments, dim blocks): ``y = down_e h`` in fp32, times the routing weight
  unless it scaled the input; the slots of a token are summed by the caller.

No host sync, shapes fixed by the number of tokens: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.triton_fused import _ACT_IDS, _activation

__all__ = ["moe_experts_gemv"]

# Tuned on an H100 (`benchmarks/gpu_sweeps.py moe-gemv`: expert shapes 2048x2048 and 5120x8192, 1-8 rows): few
# output channels per program keep enough programs in flight to saturate memory; 16 ran at half the bandwidth.
_GATE_UP = dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=3)
_DOWN = dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, gate_ptr, up_ptr, h_ptr, dim, inter, k_slots,
    stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_h,
    ACT: tl.constexpr, GATED: tl.constexpr, SCALE_INPUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)                  # assignment = token * k_slots + slot
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    ty = h_ptr.dtype.element_ty
    e = tl.load(ids_ptr + a).to(tl.int64)
    w = tl.load(w_ptr + a)
    x_row = x_ptr + (a // k_slots) * stride_xt
    acc_u = tl.zeros((BLOCK_N,), tl.float32)
    acc_g = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < dim
        x = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        if SCALE_INPUT:
            x = (x * w).to(ty).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        u = tl.load(up_ptr + e * stride_ue + n[:, None] * stride_un + kk[None, :], mask=m, other=0.0)
        acc_u += tl.sum(u.to(tl.float32) * x[None, :], 1)
        if GATED:
            g = tl.load(gate_ptr + e * stride_ge + n[:, None] * stride_gn + kk[None, :], mask=m, other=0.0)
            acc_g += tl.sum(g.to(tl.float32) * x[None, :], 1)
    up = acc_u.to(ty).to(tl.float32)
    h = _activation(up, ACT)                           # not gated: act(up)
    if GATED:
        h = _activation(acc_g.to(ty).to(tl.float32), ACT).to(ty).to(tl.float32) * up
    tl.store(h_ptr + a * stride_h + n, h.to(ty), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, dim, inter,
    stride_h, stride_de, stride_dn, stride_y,
    SCALE_INPUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < dim
    ty = h_ptr.dtype.element_ty
    e = tl.load(ids_ptr + a).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < inter
        h = tl.load(h_ptr + a * stride_h + kk, mask=k_ok, other=0.0).to(tl.float32)
        d = tl.load(down_ptr + e * stride_de + n[:, None] * stride_dn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(d.to(tl.float32) * h[None, :], 1)
    y = acc.to(ty).to(tl.float32)                      # the reference's down projection is in the model dtype
    if not SCALE_INPUT:
        y = y * tl.load(w_ptr + a)
    tl.store(y_ptr + a * stride_y + n, y, mask=n_ok)


def moe_experts_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, gate: torch.Tensor | None,
                     up: torch.Tensor, down: torch.Tensor, activation: str, scale_input: bool) -> torch.Tensor:
    """x (T, dim); ids (T, k) expert ids; weights (T, k) fp32; gate/up (E, inter, dim), down (E, dim, inter)
    -> fp32 (T, dim): the weighted sum of each token's experts (the contract of ``moe_experts_ref``)."""
    num_tokens, k = ids.shape
    dim, inter = x.shape[1], up.shape[1]
    for name, t in (("x", x), ("up", up), ("down", down), ("gate", gate)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"moe_experts_gemv: {name} needs a contiguous last dim")
    flat_ids = ids.reshape(-1).contiguous()
    flat_w = weights.reshape(-1).float().contiguous()
    rows = num_tokens * k
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, dim, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y.view(num_tokens, dim)
    g = gate if gate is not None else up
    _gate_up_kernel[(rows, triton.cdiv(inter, _GATE_UP["BLOCK_N"]))](
        x, flat_ids, flat_w, g, up, h, dim, inter, k, x.stride(0), g.stride(0), g.stride(1), up.stride(0),
        up.stride(1), h.stride(0), ACT=_ACT_IDS[activation], GATED=gate is not None, SCALE_INPUT=scale_input,
        **_GATE_UP)
    _down_kernel[(rows, triton.cdiv(dim, _DOWN["BLOCK_N"]))](
        h, flat_ids, flat_w, down, y, dim, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        SCALE_INPUT=scale_input, **_DOWN)
    return y if k == 1 else y.view(num_tokens, k, dim).sum(1)

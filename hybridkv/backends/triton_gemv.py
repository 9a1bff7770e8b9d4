"""Dense ``y = x @ W^T (+ b)`` for decode-size batches (M <= 8 rows) as a Triton GEMV.

At batch 1-8 a linear layer reads its weight once and does almost no arithmetic: the step is bound by how fast
the weight streams in. One program owns BLOCK_N output channels and streams their rows of W over K, multiplying
each tile with all M rows of x at once (fp32 accumulation, one rounding to the output dtype at the end, as a
GEMM does), so W is read exactly once whatever M is. No host sync, shapes fixed by M: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "linear_gemv"]

MAX_ROWS = 8
_CONFIG = dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, M_P)
    m_ok = m < M
    acc = tl.zeros((M_P, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                          # (BLOCK_N, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)  # (M_P, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: dict | None = None) -> torch.Tensor:
    """``F.linear`` for x (M, K) with M <= ``MAX_ROWS``; weight (N, K) with contiguous rows -> (M, N) in x's
    dtype. ``config``: launch-parameter overrides (benchmark sweeps)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"linear_gemv takes at most {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"linear_gemv: x {tuple(x.shape)} / weight {tuple(weight.shape)} need contiguous K")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = {**_CONFIG, **(config or {})}
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_P=triton.next_power_of_2(M), **cfg)
    return y

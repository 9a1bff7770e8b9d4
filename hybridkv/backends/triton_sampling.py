"""Greedy sampling on the device: each row's argmax over the vocabulary, in two short launches.

A decode step's greedy tokens are ``logits.argmax(-1)``. torch ran it as one reduction over the fp32 logits
outside the step's CUDA graph (25.4 µs for 32 x 262144 on an H100, plus a memset and the launch gaps:
``benchmarks/gpu_step_gaps.py``). Here:

- ``_partials_kernel`` (``argmax_triton``): one program per (row, chunk of ``_BLOCK`` columns) finds the
  chunk's first maximum; the logits head (``triton_linear.linear_argmax_triton``) writes the same partials
  from its epilogue instead, one per (row, column block), while the logits are still in registers, so nothing
  re-reads them;
- ``_reduce_kernel`` (``reduce_partials``): one program per row takes the first partial with the largest value.

Both run inside the captured decode graph with programmatic dependent launch (``pdl.py``).

Semantics are ``torch.argmax``'s (``argmax_ref``): the first index of the maximum; NaN counts as larger than
every number (a row with a NaN gives its first NaN), so a broken model's NaN logits are not hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.layers.ops import fused_ref

__all__ = ["argmax_triton", "reduce_partials"]

_BLOCK = 2048           # columns per program of the standalone pass (8 KB of fp32 logits)
_REDUCE_BLOCK = 1024    # partials per iteration of the per-row reduction
_FAR = tl.constexpr(2**31 - 1)   # an index past any column
_NONFINITE = tl.constexpr(fused_ref.NONFINITE)


@triton.jit
def first_max(val, idx, valid, AXIS: tl.constexpr):
    """The first maximum of ``val`` along ``AXIS`` among ``valid`` entries, NaN above everything: (value,
    index). ``idx``: each entry's column, increasing along the axis. A reduction of such pairs keeps these
    semantics when its inputs are taken in column order (ties go to the earlier one)."""
    nan = (val != val) & valid
    has_nan = tl.max(nan.to(tl.int32), axis=AXIS)
    key = tl.where(valid, tl.where(nan, float("inf"), val), float("-inf"))
    best = tl.max(key, axis=AXIS)
    if AXIS == 0:
        hit = tl.where(has_nan > 0, nan, valid & (key == best))
    else:
        hit = tl.where(has_nan[:, None] > 0, nan, valid & (key == best[:, None]))
    first = tl.min(tl.where(hit, idx, _FAR), axis=AXIS)
    return tl.where(has_nan > 0, float("nan"), best), first


@triton.jit
def _partials_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, n_parts, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    part = tl.program_id(0)
    row = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    pdl_wait(PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    best, first = first_max(x, cols, ok, 0)
    tl.store(val_ptr + row * n_parts + part, best)
    tl.store(idx_ptr + row * n_parts + part, first)


@triton.jit
def _reduce_kernel(val_ptr, idx_ptr, out_ptr, report_ptr, n_parts, BLOCK: tl.constexpr, REPORT: tl.constexpr,
                   PDL: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    pdl_wait(PDL)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], _FAR, tl.int32)
    for start in range(0, n_parts, BLOCK):
        ok = start + offs < n_parts
        val = tl.load(val_ptr + row * n_parts + start + offs, mask=ok, other=float("-inf"))
        idx = tl.load(idx_ptr + row * n_parts + start + offs, mask=ok, other=_FAR)
        v, col = first_max(val, idx, ok, 0)       # partials are in column order: the smallest column is first
        # the earlier chunk wins ties; a NaN, once seen, stays
        take = ((v != v) & (best == best)) | (v > best) | ((best_idx == _FAR) & (col < _FAR))
        best = tl.where(take, v, best)
        best_idx = tl.where(take, col, best_idx)
    tl.store(out_ptr + row, best_idx.to(tl.int64))
    if REPORT:          # the chosen logit is the row's maximum: NaN (chosen first) or +-inf -> NONFINITE
        finite = (best == best) & (tl.abs(best) < float("inf"))
        tl.store(report_ptr + row, tl.where(finite, best_idx.to(tl.int64), _NONFINITE))


def reduce_partials(values: torch.Tensor, indices: torch.Tensor, *, out: torch.Tensor | None = None,
                    report: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, parts) fp32 partial maxima and their int32 columns, in column order -> (rows,) int64 tokens,
    written into ``out`` when given; ``report`` as ``argmax_ref``'s (one more store, no extra launch)."""
    rows, parts = values.shape
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64):
        raise ValueError(f"argmax: out must be ({rows},) int64, got {tuple(out.shape)} {out.dtype}")
    if report is not None and (report.shape != (rows,) or report.dtype != torch.int64):
        raise ValueError(f"argmax: report must be ({rows},) int64, got {tuple(report.shape)} {report.dtype}")
    tokens = out if out is not None else torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows:
        _reduce_kernel[(rows,)](values, indices, tokens, report if report is not None else tokens, parts,
                                BLOCK=min(_REDUCE_BLOCK, triton.next_power_of_2(parts)), REPORT=report is not None,
                                num_warps=4, **pdl_kwargs(values.device))
    return tokens


def argmax_triton(logits: torch.Tensor, *, out: torch.Tensor | None = None,
                  report: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax_ref``: logits (rows, vocab), any float dtype, unit stride along the vocabulary -> (rows,)
    int64, written into ``out`` (rows,) when given."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax: expected (rows, vocab) with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax: empty vocabulary")
    parts = triton.cdiv(vocab, _BLOCK)
    values = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    if rows:
        _partials_kernel[(parts, rows)](logits, values, indices, vocab, logits.stride(0), parts, BLOCK=_BLOCK,
                                        num_warps=8, **pdl_kwargs(logits.device))
    return reduce_partials(values, indices, out=out, report=report)

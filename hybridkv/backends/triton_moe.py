"""Routed experts for decode- and mid-size batches in Triton: GEMVs per assignment (``layers/moe.py`` impl
"gemv") and masked tiles per expert (impl "tiled").

With a handful of (token, slot) assignments, a grouped GEMM spends its time on tile setup and reads the
weights at a fraction of the memory bandwidth; a GEMV per assignment that reads only its expert's rows is
bandwidth-bound, which is the best a decode step can do. Each assignment reads its expert's weights once,
so the kernels only pay off while assignments rarely share an expert (``layers.moe.GEMV_MAX_ROWS``).

With a few dozen assignments the experts are shared, and the sort, gathers and scatter around a grouped GEMM
cost as much as the GEMM. The tiled kernels need none of them: a program owns one expert and BLOCK_N output
channels, reads every assignment's expert id, picks its own rows out of them in registers (a rank by prefix
sum, then a one-hot pick, 128 ids at a time: ``_expert_rows``) and multiplies them in tiles of 16 rows
(``_TILED_BLOCK_M``) while reading its weight slice (a second tile of a busy expert reads it again, from L2); no
block size depends on the assignment count, so one compiled kernel serves every batch. The tile holds the
expert's rows only: taking every assignment as the M tile with the other experts' rows masked spent E x the
tensor-core FLOPs (BLOCK_M FLOPs per weight byte, 128 at 128 rows) and ran gpt-oss-like experts at half the
memory bandwidth on an H200. Experts without an assignment return after reading the ids.

- ``_gate_up_kernel``: grid (assignments, inter blocks): ``h = act(gate_e x) * up_e x`` for BLOCK_N output
  channels, x scaled by the routing weight first for Llama-4 (``scale_input``), rounded where the reference
  rounds (x, gate, up, act, h in the model dtype; fp32 accumulation).
- ``_down_kernel``: grid (assignments, dim blocks): ``y = down_e h`` in fp32, times the routing weight
  unless it scaled the input. With one slot per token it stores the layer's output in the model dtype, plus
  the shared expert's output when given (``addend``, times the sigmoid of its gate logit when given); with more,
  each program stores its slot in fp32 and the token's last program to finish an output block (an arrival
  counter per (token, block)) sums the slots and stores the layer's output: two launches per layer fewer than
  a torch sum and cast after (five with Qwen3-Next's gated shared expert). (Summing a token's slots inside one
  program instead, grid (tokens, dim blocks), serialized the slots' weight reads: gpt-oss-like batch-1 decode
  1.10 -> 1.18 ms on an H200.)
- ``_gate_up_tiled_kernel`` / ``_down_tiled_kernel``: the same two steps, grid (experts, output blocks),
  rounded at the same places.
- gpt-oss experts: biases after each projection (``HAS_BIAS``, rounded to the model dtype after the product as
  the reference does) and the clamped SwiGLU ``swiglu_oai`` (``ACT`` 4, ``_swiglu_oai``), both compiled out for
  the other families.
- ``_route_kernel`` (the backend's ``moe_route``): one program per token turns the router's logits into its
  top-k expert ids and weights (scoring, correction bias, renormalisation, scaling), where torch launches a
  cast, a top-k, a sigmoid or softmax and a product per MoE layer (``moe_route_ref``); ``_linear_route_kernel``
  (``linear_moe_route``, up to 8 tokens): the router's GEMV with that routing in the token's last program.
- ``_combine_kernel`` (``moe_combine``): one program per (token, output block) sums the token's slots, read
  through a permutation (the grouped GEMM's expert-sorted rows) or in place (the tiled kernels' fp32 slots),
  weighted or not, then rounds and adds the (gated) shared expert (``moe_combine_ref``).

No host sync, shapes fixed by the number of tokens: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridkv.backends.jit_forms import two_forms
from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_fused import _ACT_IDS, _activation
from hybridkv.backends.triton_linear import MAX_COUNTERS, counters, linear
from hybridkv.layers.ops.fused_ref import ROUTERS, moe_route_ref

__all__ = ["linear_moe_route", "linear_moe_route_triton", "moe_combine", "moe_experts_gemv", "moe_experts_tiled",
           "moe_route", "moe_route_triton"]

# GEMV launch configurations by the experts' intermediate size (``_gemv_width``): few output channels per program
# keep enough programs in flight to saturate memory (16 ran at half the bandwidth on an H100); stages change
# nothing (the loops do not pipeline). The best of an H200 sweep at one token over rows per program, K step and
# warps, each kernel swept with the other at the previous 4 rows x 256 on 4 warps (``benchmarks/gpu_moe.py
# --sweep-gemv``; µs a layer, gate_up + down): "wide" experts (gpt-oss-like, 2048 x 2048, top-4) take 2 rows in
# 512-wide K steps on 2 warps (31.5 -> 31.0 gate_up, -> 30.6 down); "narrow" ones (Qwen3-Next-like, 512 x 2048,
# top-8) 2 rows in 1024-wide steps for gate_up (20.0 -> 18.3) and 8 rows in 256-wide steps for down (-> 18.9).
# Batch-1 decode, same run each: gpt-oss-like 0.992 -> 0.970 ms, Qwen3-Next-like 1.285 -> 1.238 ms.
_GATE_UP = {"wide": dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=1),
            "narrow": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1)}
_DOWN = {"wide": dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=1),
         "narrow": dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=1)}


def _gemv_width(inter: int) -> str:
    return "wide" if inter >= 1024 else "narrow"


# Tiled kernels: the best of an H100 sweep of the masked-M-tile form (16-128 assignments of 2048x2048 experts);
# with an expert's own rows per tile they read the weights at ~96% of the copy bandwidth (H200, 32 tokens x top-4 of
# 32 gpt-oss-like experts: 198 us, ``benchmarks/gpu_moe.py``), so the configuration is not re-swept yet.
_TILED_GATE_UP = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3)
_TILED_DOWN = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
_TILED_MAX_ROWS = 512      # assignments per launch
_TILED_BLOCK_M = 16        # an expert's rows per tile (tl.dot's minimum); more rows: more tiles
_TILED_SLICE = 128         # ids ranked and picked per slice (``_expert_rows``)
_SMEM_BUDGET = 160 * 1024      # bytes of pipelined tiles per program (an H100 SM has 228 KiB)


_MOE_ACT_IDS = {**_ACT_IDS, "swiglu_oai": 4}     # 4: gated only, computed by ``_swiglu_oai``


@triton.jit
def _swiglu_oai(g, u, alpha, limit, ty: tl.constexpr):
    """``activations.swiglu_oai`` on fp32 values already rounded to ``ty``, rounding where torch rounds in ``ty``:
    ``(clamp(u, -L, L) + 1) * (g' * sigmoid(g' * alpha))`` with ``g' = min(g, L)``."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    ga = (g * alpha).to(ty).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-ga))).to(ty).to(tl.float32)
    glu = (g * sig).to(ty).to(tl.float32)
    return (u + 1.0).to(ty).to(tl.float32) * glu


@triton.jit
def _biased(acc, b_ptrs, mask, ty: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A projection's fp32 accumulator rounded to ``ty``, plus its bias rounded again (``proj(x) + b``)."""
    y = acc.to(ty).to(tl.float32)
    if HAS_BIAS:
        y = (y + tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    return y


@triton.jit
def _gated(g, u, alpha, limit, ty: tl.constexpr, ACT: tl.constexpr):
    """The gated activation of rounded fp32 gate and up values: ``act(g) * u`` or gpt-oss's ``_swiglu_oai``."""
    if ACT == 4:  # noqa: SIM108  (constexpr branch)
        h = _swiglu_oai(g, u, alpha, limit, ty)
    else:
        h = _activation(g, ACT).to(ty).to(tl.float32) * u
    return h


@functools.cache
def _tiled_config(kernel: str, block_m: int, itemsize: int) -> dict:
    """``kernel``'s ("gate_up" or "down") configuration with as many pipeline stages (then as wide a BLOCK_K)
    as fit ``_SMEM_BUDGET`` for an A tile of ``block_m`` rows (fp32 models get fewer than bf16)."""
    base = _TILED_GATE_UP if kernel == "gate_up" else _TILED_DOWN
    b_tiles = 2 if kernel == "gate_up" else 1                # gate and up tiles share each A tile
    cfg = dict(base)
    while True:
        stage = (block_m + b_tiles * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * itemsize
        cfg["num_stages"] = min(base["num_stages"], _SMEM_BUDGET // stage)
        if cfg["num_stages"] >= 2 or cfg["BLOCK_K"] <= 32:
            cfg["num_stages"] = max(1, cfg["num_stages"])
            return cfg
        cfg["BLOCK_K"] //= 2


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, gate_ptr, up_ptr, h_ptr, gb_ptr, ub_ptr, dim, inter, k_slots, alpha, limit,
    stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_h, stride_gbe, stride_ube,
    ACT: tl.constexpr, GATED: tl.constexpr, SCALE_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
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
    up = _biased(acc_u, ub_ptr + e * stride_ube + n, n_ok, ty, HAS_BIAS)
    if GATED:
        h = _gated(_biased(acc_g, gb_ptr + e * stride_gbe + n, n_ok, ty, HAS_BIAS), up, alpha, limit, ty, ACT)
    else:
        h = _activation(up, ACT)                       # not gated: act(up)
    tl.store(h_ptr + a * stride_h + n, h.to(ty), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, add_ptr, gl_ptr, db_ptr, out_ptr, cnt_ptr, dim, inter, k_slots,
    stride_h, stride_de, stride_dn, stride_y, stride_add, stride_gl, stride_dbe, stride_out,
    SCALE_INPUT: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    FINISH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
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
    y = _biased(acc, db_ptr + e * stride_dbe + n, n_ok, ty, HAS_BIAS)   # the reference's projection: model dtype
    if not SCALE_INPUT:
        y = y * tl.load(w_ptr + a)
    t = a // k_slots
    if FINISH:
        # Several slots per token: each program stores its fp32 slot, and the token's last program to arrive at
        # this output block (a per-(token, block) counter, which it resets for the next launch) sums the slots in
        # slot order and stores the layer's output: no reduction and cast kernels after, no slot's weight read
        # waiting on another's. The barrier and the counter's acq_rel order the block's stores before the count.
        tl.store(y_ptr + a * stride_y + n, y, mask=n_ok)
        tl.debug_barrier()
        cnt = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(cnt, 1, sem="acq_rel") == k_slots - 1:
            total = tl.zeros((BLOCK_N,), tl.float32)
            for j in range(k_slots):
                total += tl.load(y_ptr + (t * k_slots + j) * stride_y + n, mask=n_ok, other=0.0,
                                 cache_modifier=".cg")
            total = _plus(total, add_ptr + t * stride_add + n, gl_ptr + t * stride_gl, n_ok,
                          out_ptr.dtype.element_ty, HAS_ADD, HAS_GATE)
            tl.store(out_ptr + t * stride_out + n, total, mask=n_ok)
            tl.store(cnt, 0)
    else:
        y = _plus(y, add_ptr + t * stride_add + n, gl_ptr + t * stride_gl, n_ok, y_ptr.dtype.element_ty, HAS_ADD,
                  HAS_GATE)
        tl.store(y_ptr + a * stride_y + n, y, mask=n_ok)


@triton.jit
def _plus(y, add_ptrs, gate_ptrs, mask, out_ty: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr):
    """y rounded to the output dtype, plus the addend (the shared expert's output), first scaled by the sigmoid of
    its gate logit when ``HAS_GATE`` (Qwen3-Next's shared-expert gate), each product rounded as the reference's."""
    if HAS_ADD:
        add = tl.load(add_ptrs, mask=mask, other=0.0)
        if HAS_GATE:
            g = tl.load(gate_ptrs).to(tl.float32)
            g = (1.0 / (1.0 + tl.exp(-g))).to(gate_ptrs.dtype.element_ty).to(tl.float32)
            add = (add.to(tl.float32) * g).to(add.dtype)
        y = y.to(out_ty).to(tl.float32) + add.to(tl.float32)
    return y.to(out_ty)


@triton.jit
def _combine_kernel(
    y_ptr, pos_ptr, w_ptr, add_ptr, gl_ptr, out_ptr, dim, k_slots, stride_y, stride_add, stride_gl, stride_out,
    HAS_POS: tl.constexpr, WEIGHTED: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """One (token, output block): the token's slots (rows ``pos[t * k + j]``, or ``t * k + j``), times their
    routing weights when WEIGHTED, summed in slot order in fp32, rounded and joined by the addend (``_plus``)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < dim
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(k_slots):
        a = t * k_slots + j
        row = tl.load(pos_ptr + a).to(tl.int64) if HAS_POS else a
        y = tl.load(y_ptr + row * stride_y + n, mask=n_ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = y * tl.load(w_ptr + a)
        total += y
    total = _plus(total, add_ptr + t * stride_add + n, gl_ptr + t * stride_gl, n_ok, out_ptr.dtype.element_ty,
                  HAS_ADD, HAS_GATE)
    tl.store(out_ptr + t * stride_out + n, total, mask=n_ok)


def moe_combine(y: torch.Tensor, *, k: int, out_dtype: torch.dtype, positions: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_combine_ref``'s contract in one launch: y (T*k, dim) per-slot outputs (contiguous rows); positions
    (T*k,) int; weights (T, k) fp32 -> (T, dim) in ``out_dtype``. Replaces the gather, product, sum, cast and
    addend kernels after a grouped GEMM (~1.1 ms a layer at 8192 x top-8 of 2048 channels on an H200)."""
    num_tokens = y.shape[0] // k
    dim = y.shape[1]
    out = torch.empty(num_tokens, dim, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    a = _addend_args(addend, addend_gate, True, out)
    w = weights.reshape(-1).contiguous() if weights is not None else y
    block = min(1024, triton.next_power_of_2(dim))
    _combine_kernel[(num_tokens, triton.cdiv(dim, block))](
        y, positions if positions is not None else y, w, a["add"], a["gl"], out, dim, k, y.stride(0),
        a["add"].stride(0), a["gl"].stride(0), out.stride(0), HAS_POS=positions is not None,
        WEIGHTED=weights is not None, HAS_ADD=a["has_add"], HAS_GATE=a["has_gate"], BLOCK_N=block,
        num_warps=max(1, min(8, block // 256)), **pdl_kwargs(y.device))
    return out


@triton.jit
def _expert_count(ids_ptr, rows, e, SLICE: tl.constexpr):
    """How many of the ``rows`` assignments chose expert ``e`` (one pass over the ids, ``SLICE`` at a time)."""
    count = tl.full((), 0, tl.int32)
    for c in range(0, rows, SLICE):
        r = c + tl.arange(0, SLICE)
        count += tl.sum((tl.load(ids_ptr + r, mask=r < rows, other=-1) == e).to(tl.int32), 0)
    return count


@triton.jit
def _expert_rows(ids_ptr, rows, e, j0, count, BLOCK_M: tl.constexpr, SLICE: tl.constexpr):
    """Expert ``e``'s assignments j0 .. j0 + BLOCK_M (of ``count``), in order: (row index, valid). Each ``SLICE`` of
    the ids ranks its matches by a prefix sum, and a one-hot (BLOCK_M, SLICE) product picks them out of registers
    (Triton has no register gather). Slices keep that product small: one over 512 ids spilled at sm_90."""
    j = j0 + tl.arange(0, BLOCK_M)
    row = tl.zeros((BLOCK_M,), tl.int32)
    before = tl.full((), 0, tl.int32)
    for c in range(0, rows, SLICE):
        r = c + tl.arange(0, SLICE)
        mine = (tl.load(ids_ptr + r, mask=r < rows, other=-1) == e).to(tl.int32)
        pos = tl.where(mine > 0, tl.cumsum(mine, 0) - 1 + before, -1)
        row += tl.sum(tl.where(pos[None, :] == j[:, None], r[None, :], 0), 1)
        before += tl.sum(mine, 0)
    return row, j < count


def _gate_up_tiled(
    x_ptr, ids_ptr, w_ptr, gate_ptr, up_ptr, h_ptr, gb_ptr, ub_ptr, rows, dim, inter, k_slots, alpha, limit,
    stride_xt, stride_ge, stride_gn, stride_ue, stride_un, stride_h, stride_gbe, stride_ube,
    ACT: tl.constexpr, GATED: tl.constexpr, SCALE_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    e = tl.program_id(0)
    count = _expert_count(ids_ptr, rows, e, SLICE)     # of the assignments (token * k_slots + slot)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    ty = h_ptr.dtype.element_ty
    e64 = e.to(tl.int64)
    up_cols = up_ptr + e64 * stride_ue + n[None, :] * stride_un              # (1, BLOCK_N)
    gate_cols = gate_ptr + e64 * stride_ge + n[None, :] * stride_gn
    for j0 in range(0, count, BLOCK_M):                # experts without an assignment skip the loop
        row, row_ok = _expert_rows(ids_ptr, rows, e, j0, count, BLOCK_M, SLICE)
        x_rows = x_ptr + (row // k_slots).to(tl.int64)[:, None] * stride_xt      # (BLOCK_M, 1)
        w = tl.load(w_ptr + row, mask=row_ok, other=0.0)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, dim, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < dim
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            if SCALE_INPUT:
                a = (a.to(tl.float32) * w[:, None]).to(ty)
            m = k_ok[:, None] & n_ok[None, :]
            u = tl.load(up_cols + kk[:, None], mask=m, other=0.0)                   # (BLOCK_K, BLOCK_N)
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            if GATED:
                g = tl.load(gate_cols + kk[:, None], mask=m, other=0.0)
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
        up = _biased(acc_u, ub_ptr + e64 * stride_ube + n[None, :], n_ok[None, :], ty, HAS_BIAS)
        if GATED:
            g = _biased(acc_g, gb_ptr + e64 * stride_gbe + n[None, :], n_ok[None, :], ty, HAS_BIAS)
            h = _gated(g, up, alpha, limit, ty, ACT)
        else:
            h = _activation(up, ACT)                   # not gated: act(up)
        tl.store(h_ptr + row[:, None] * stride_h + n[None, :], h.to(ty), mask=row_ok[:, None] & n_ok[None, :])


# assignments (and the chunk offsets of a large batch) change per step
_gate_up_tiled_kernel = two_forms(_gate_up_tiled, per_step=["rows"], per_step_pointers=["ids_ptr", "w_ptr"])


def _down_tiled(
    h_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, add_ptr, gl_ptr, db_ptr, rows, dim, inter,
    stride_h, stride_de, stride_dn, stride_y, stride_add, stride_gl, stride_dbe,
    SCALE_INPUT: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    SLICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    e = tl.program_id(0)
    count = _expert_count(ids_ptr, rows, e, SLICE)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < dim
    ty = h_ptr.dtype.element_ty
    down_cols = down_ptr + e.to(tl.int64) * stride_de + n[None, :] * stride_dn
    for j0 in range(0, count, BLOCK_M):
        row, row_ok = _expert_rows(ids_ptr, rows, e, j0, count, BLOCK_M, SLICE)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            a = tl.load(h_ptr + row[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            d = tl.load(down_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, d, acc, input_precision="ieee")
        y = _biased(acc, db_ptr + e.to(tl.int64) * stride_dbe + n[None, :], n_ok[None, :], ty, HAS_BIAS)
        if not SCALE_INPUT:
            y = y * tl.load(w_ptr + row, mask=row_ok, other=0.0)[:, None]
        m = row_ok[:, None] & n_ok[None, :]
        y = _plus(y, add_ptr + row[:, None] * stride_add + n[None, :], gl_ptr + row[:, None] * stride_gl, m,
                  y_ptr.dtype.element_ty, HAS_ADD, HAS_GATE)      # one slot per token when HAS_ADD: row = token
        tl.store(y_ptr + row[:, None] * stride_y + n[None, :], y, mask=m)


_down_tiled_kernel = two_forms(_down_tiled, per_step=["rows"], per_step_pointers=["ids_ptr", "w_ptr"])


def _buffers(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, gate: torch.Tensor | None,
             up: torch.Tensor, down: torch.Tensor, addend: torch.Tensor | None, addend_gate: torch.Tensor | None,
             activation: str, biases: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
    """Checked inputs and the kernels' buffers: flat ids, flat fp32 weights (T*k,); h (T*k, inter) in x's
    dtype; y (T*k, dim): x's dtype with one slot per token (the down kernel writes the layer's output), else
    fp32 (the slots' weighted products: the GEMV's last program per token sums them, or ``moe_combine`` after)."""
    gate_bias, up_bias, down_bias = biases
    for name, t in (("x", x), ("up", up), ("down", down), ("gate", gate), ("addend", addend),
                    ("gate_bias", gate_bias), ("up_bias", up_bias), ("down_bias", down_bias)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"MoE Triton kernels: {name} needs a contiguous last dim")
    if activation not in _MOE_ACT_IDS:
        raise ValueError(f"MoE Triton kernels: unknown activation {activation!r}; known: {sorted(_MOE_ACT_IDS)}")
    if activation == "swiglu_oai" and gate is None:
        raise ValueError("MoE Triton kernels: swiglu_oai needs gated experts")
    if gate is not None and (gate_bias is None) != (up_bias is None):
        raise ValueError("MoE Triton kernels: gate and up biases come together")
    if addend is not None and addend.shape != x.shape:
        raise ValueError(f"MoE Triton kernels: addend {tuple(addend.shape)} vs x {tuple(x.shape)}")
    if addend_gate is not None and (addend is None or addend_gate.shape != (x.shape[0], 1)
                                    or addend_gate.dtype != addend.dtype):
        raise ValueError(f"MoE Triton kernels: addend_gate must be ({x.shape[0]}, 1) logits in the addend's dtype "
                         f"beside an addend, got {tuple(addend_gate.shape)} {addend_gate.dtype}")
    rows = ids.numel()
    h = torch.empty(rows, up.shape[1], dtype=x.dtype, device=x.device)
    y = torch.empty(rows, x.shape[1], dtype=x.dtype if ids.shape[1] == 1 else torch.float32, device=x.device)
    return ids.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous(), h, y


def _finish(y: torch.Tensor, x: torch.Tensor, k: int, addend: torch.Tensor | None,
            addend_gate: torch.Tensor | None) -> torch.Tensor:
    """(T*k, dim) per-slot outputs -> the layer's (T, dim) in x's dtype (one slot: already done in-kernel)."""
    if k == 1:
        return y
    return moe_combine(y, k=k, out_dtype=x.dtype, addend=addend, addend_gate=addend_gate)


def _addend_args(addend: torch.Tensor | None, addend_gate: torch.Tensor | None, in_kernel: bool,
                 fallback: torch.Tensor) -> dict:
    """The down kernels' addend and gate-logit pointers and flags: the (gated) shared expert's output joins in the
    kernel's store when ``in_kernel`` (``fallback`` where absent: never read)."""
    has_add = addend is not None and in_kernel
    has_gate = has_add and addend_gate is not None
    return dict(add=addend if has_add else fallback, gl=addend_gate if has_gate else fallback, has_add=has_add,
                has_gate=has_gate)


def _bias_args(gate: torch.Tensor | None, up: torch.Tensor, gate_bias: torch.Tensor | None,
               up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, fallback: torch.Tensor) -> dict:
    """The kernels' bias pointers and strides (``fallback`` where a bias is absent: never read)."""
    gb = gate_bias if gate_bias is not None else (up_bias if up_bias is not None else fallback)
    ub = up_bias if up_bias is not None else fallback
    db = down_bias if down_bias is not None else fallback
    return dict(gb=gb, ub=ub, db=db, has_up=up_bias is not None, has_down=down_bias is not None)


def moe_experts_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, gate: torch.Tensor | None,
                     up: torch.Tensor, down: torch.Tensor, activation: str, scale_input: bool,
                     addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
                     gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """x (T, dim); ids (T, k) expert ids; weights (T, k) fp32; gate/up (E, inter, dim), down (E, dim, inter)
    -> (T, dim) in x's dtype: the weighted sum of each token's experts, summed in fp32 and rounded once (the
    values of ``moe_experts_ref``), plus ``addend`` (T, dim) when given, rounded again (``out + addend``: the
    shared expert's output), scaled first by ``sigmoid(addend_gate)`` ((T, 1) logits) when given. The down kernel
    stores the result (its last slot to finish sums them). Biases: gate/up (E, inter), down (E, dim); ``alpha`` /
    ``limit``: ``swiglu_oai``'s."""
    num_tokens, k = ids.shape
    dim, inter, rows = x.shape[1], up.shape[1], ids.numel()
    flat_ids, flat_w, h, y = _buffers(x, ids, weights, gate=gate, up=up, down=down, addend=addend,
                                      addend_gate=addend_gate, activation=activation,
                                      biases=(gate_bias, up_bias, down_bias))
    if rows == 0:
        return y.view(num_tokens, dim).to(x.dtype)
    g = gate if gate is not None else up
    b = _bias_args(gate, up, gate_bias, up_bias, down_bias, x)
    up_cfg, down_cfg = _GATE_UP[_gemv_width(inter)], _DOWN[_gemv_width(inter)]
    n_blocks = triton.cdiv(dim, down_cfg["BLOCK_N"])
    # several slots: the down kernel's last program per (token, block) sums them, while the counters cover the
    # batch (decode sizes, what ``auto`` gives it); a larger forced batch sums them after, as the tiled path does
    finish = k > 1 and num_tokens * n_blocks <= MAX_COUNTERS
    _gate_up_kernel[(rows, triton.cdiv(inter, up_cfg["BLOCK_N"]))](
        x, flat_ids, flat_w, g, up, h, b["gb"], b["ub"], dim, inter, k, float(alpha), float(limit), x.stride(0),
        g.stride(0), g.stride(1), up.stride(0), up.stride(1), h.stride(0), b["gb"].stride(0), b["ub"].stride(0),
        ACT=_MOE_ACT_IDS[activation], GATED=gate is not None, SCALE_INPUT=scale_input, HAS_BIAS=b["has_up"],
        **up_cfg, **pdl_kwargs(x.device))
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device) if finish else y
    a = _addend_args(addend, addend_gate, k == 1 or finish, y)
    _down_kernel[(rows, n_blocks)](
        h, flat_ids, flat_w, down, y, a["add"], a["gl"], b["db"], out, counters(x.device) if finish else flat_ids,
        dim, inter, k, h.stride(0), down.stride(0), down.stride(1), y.stride(0), a["add"].stride(0),
        a["gl"].stride(0), b["db"].stride(0), out.stride(0), SCALE_INPUT=scale_input, HAS_ADD=a["has_add"],
        HAS_GATE=a["has_gate"], HAS_BIAS=b["has_down"], FINISH=finish, **down_cfg, **pdl_kwargs(h.device))
    return out if finish else _finish(y, x, k, addend, addend_gate)


def moe_experts_tiled(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, gate: torch.Tensor | None,
                      up: torch.Tensor, down: torch.Tensor, activation: str, scale_input: bool,
                      addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
                      gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``moe_experts_gemv``'s contract with one program per (expert, output block) over its assignments, the
    slots summed after (torch) unless one per token. A launch takes at most ``_TILED_MAX_ROWS`` assignments:
    larger batches run in token chunks of that many."""
    num_tokens, k = ids.shape
    dim, inter, num_experts = x.shape[1], up.shape[1], up.shape[0]
    flat_ids, flat_w, h, y = _buffers(x, ids, weights, gate=gate, up=up, down=down, addend=addend,
                                      addend_gate=addend_gate, activation=activation,
                                      biases=(gate_bias, up_bias, down_bias))
    g = gate if gate is not None else up
    b = _bias_args(gate, up, gate_bias, up_bias, down_bias, x)
    a = _addend_args(addend, addend_gate, k == 1, y)
    chunk = max(1, _TILED_MAX_ROWS // k)               # tokens per launch
    up_cfg = _tiled_config("gate_up", _TILED_BLOCK_M, x.element_size())
    down_cfg = _tiled_config("down", _TILED_BLOCK_M, x.element_size())
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        r0, r1 = t0 * k, t1 * k
        _gate_up_tiled_kernel.pick(x)[(num_experts, triton.cdiv(inter, up_cfg["BLOCK_N"]))](
            x[t0:t1], flat_ids[r0:r1], flat_w[r0:r1], g, up, h[r0:r1], b["gb"], b["ub"], r1 - r0, dim, inter, k,
            float(alpha), float(limit), x.stride(0), g.stride(0), g.stride(1), up.stride(0), up.stride(1),
            h.stride(0), b["gb"].stride(0), b["ub"].stride(0), ACT=_MOE_ACT_IDS[activation], GATED=gate is not None,
            SCALE_INPUT=scale_input, HAS_BIAS=b["has_up"], SLICE=_TILED_SLICE, BLOCK_M=_TILED_BLOCK_M, **up_cfg,
            **pdl_kwargs(x.device))
        _down_tiled_kernel.pick(x)[(num_experts, triton.cdiv(dim, down_cfg["BLOCK_N"]))](
            h[r0:r1], flat_ids[r0:r1], flat_w[r0:r1], down, y[r0:r1], a["add"][t0:t1],    # (fallbacks: never read)
            a["gl"][t0:t1], b["db"], r1 - r0, dim, inter, h.stride(0), down.stride(0),
            down.stride(1), y.stride(0), a["add"].stride(0), a["gl"].stride(0), b["db"].stride(0),
            SCALE_INPUT=scale_input, HAS_ADD=a["has_add"], HAS_GATE=a["has_gate"], HAS_BIAS=b["has_down"],
            SLICE=_TILED_SLICE, BLOCK_M=_TILED_BLOCK_M, **down_cfg, **pdl_kwargs(h.device))
    return _finish(y, x, k, addend, addend_gate)


ROUTE_MAX_EXPERTS = 4096        # one program holds a token's logits in registers


@triton.jit
def _top_k(logit, ok, offs, bias_ptr, scaling, SCORING: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
           HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's fp32 logits (BLOCK_E,) -> its (BLOCK_K,) expert ids and weights, the first TOP_K valid."""
    if SCORING == 0:                                   # softmax: choose by the probabilities themselves
        m = tl.max(tl.where(ok, logit, float("-inf")), 0)
        p = tl.where(ok, tl.exp(logit - m), 0.0)
        score = p / tl.sum(p, 0)
        choice = tl.where(ok, score, float("-inf"))
    elif SCORING == 1 or SCORING == 3:                 # sigmoid_input, topk_softmax: choose by the logits
        score = logit
        choice = tl.where(ok, logit, float("-inf"))
    else:                                              # sigmoid_bias: choose by score + correction bias
        score = 1.0 / (1.0 + tl.exp(-logit))
        choice = tl.where(ok, score + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    sel_ids = tl.zeros((BLOCK_K,), tl.int64)
    sel_w = tl.zeros((BLOCK_K,), tl.float32)
    for j in tl.static_range(TOP_K):                   # best first; ties to the lowest expert id
        best = tl.argmax(choice, 0, tie_break_left=True)
        w = tl.sum(tl.where(offs == best, score, 0.0), 0)
        if SCORING == 1:
            w = 1.0 / (1.0 + tl.exp(-w))
        sel_ids = tl.where(slots == j, best.to(tl.int64), sel_ids)
        sel_w = tl.where(slots == j, w, sel_w)
        choice = tl.where(offs == best, float("-inf"), choice)
    if SCORING == 3:                                   # topk_softmax: softmax over the k chosen logits
        top = tl.max(tl.where(slots < TOP_K, sel_w, float("-inf")), 0)
        ex = tl.where(slots < TOP_K, tl.exp(sel_w - top), 0.0)
        sel_w = ex / tl.sum(ex, 0)
    if RENORM:
        total = tl.sum(sel_w, 0)
        if SCORING == 2:
            total += 1e-20
        sel_w = sel_w / total
    if HAS_SCALE:
        sel_w = sel_w * scaling
    return sel_ids, sel_w


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, stride_i, stride_w, scaling,
    SCORING: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=0.0).to(tl.float32)
    sel_ids, sel_w = _top_k(logit, ok, offs, bias_ptr, scaling, SCORING, TOP_K, RENORM, HAS_SCALE, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + row * stride_i + slots, sel_ids, mask=slots < TOP_K)
    tl.store(w_ptr + row * stride_w + slots, sel_w, mask=slots < TOP_K)


@triton.jit
def _linear_route_kernel(
    x_ptr, wt_ptr, b_ptr, logits_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr, K, N, E, stride_x, stride_wt, stride_l,
    stride_i, stride_w, scaling,
    HAS_BIAS: tl.constexpr, SCORING: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """grid (tokens, N blocks): each program streams BLOCK_N router rows for one token and stores those logits
    (rounded once to the model dtype, as ``F.linear``); the token's last program to finish (a counter per token,
    which it resets) reads all E of them back and routes, as ``_route_kernel`` does: one launch for both."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_KD):
        kk = k0 + tl.arange(0, BLOCK_KD)
        k_ok = kk < K
        xv = tl.load(x_ptr + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(wt_ptr + n[:, None].to(tl.int64) * stride_wt + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0)
        acc += tl.sum(wv.to(tl.float32) * xv[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(logits_ptr + t * stride_l + n, acc.to(logits_ptr.dtype.element_ty), mask=n_ok)
    tl.debug_barrier()                                 # every thread's logits issued before the release
    cnt = cnt_ptr + t
    if tl.atomic_add(cnt, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        logit = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        sel_ids, sel_w = _top_k(logit, ok, offs, bias_ptr, scaling, SCORING, TOP_K, RENORM, HAS_SCALE, BLOCK_K)
        slots = tl.arange(0, BLOCK_K)
        tl.store(ids_ptr + t * stride_i + slots, sel_ids, mask=slots < TOP_K)
        tl.store(w_ptr + t * stride_w + slots, sel_w, mask=slots < TOP_K)
        tl.store(cnt, 0)                               # ready for the next launch (or graph replay)


def _route_check(num_experts: int, *, router: str, top_k: int, correction_bias: torch.Tensor | None) -> int:
    """The kernels' routing arguments checked; returns the router's ``SCORING`` id."""
    if router not in ROUTERS:
        raise ValueError(f"moe_route: router must be one of {ROUTERS}, got {router!r}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"moe_route: top_k={top_k} must be in [1, num_experts={num_experts}]")
    if num_experts > ROUTE_MAX_EXPERTS:
        raise ValueError(f"moe_route_triton: at most {ROUTE_MAX_EXPERTS} experts, got {num_experts}")
    scoring = ROUTERS.index(router)
    if scoring == 2 and (correction_bias is None or correction_bias.shape != (num_experts,)):
        raise ValueError(f"moe_route: the 'sigmoid_bias' router needs a ({num_experts},) correction_bias")
    return scoring


def _route_constexprs(scoring: int, num_experts: int, top_k: int, renormalize: bool, scaling: float) -> dict:
    return dict(SCORING=scoring, TOP_K=top_k, RENORM=renormalize and scoring in (0, 2), HAS_SCALE=scaling != 1.0,
                BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k))


def moe_route_triton(logits: torch.Tensor, *, router: str, top_k: int, renormalize: bool = False,
                     scaling: float = 1.0, correction_bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route_ref``'s contract without expert groups (``num_groups == topk_groups``), one launch."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"moe_route: expected (num_tokens, num_experts) logits with a contiguous last dim, got "
                         f"shape {tuple(logits.shape)} strides {logits.stride()}")
    num_tokens, num_experts = logits.shape
    scoring = _route_check(num_experts, router=router, top_k=top_k, correction_bias=correction_bias)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens:
        consts = _route_constexprs(scoring, num_experts, top_k, renormalize, scaling)
        _route_kernel[(num_tokens,)](
            logits, correction_bias if scoring == 2 else logits, ids, weights, num_experts, logits.stride(0),
            ids.stride(0), weights.stride(0), scaling, **consts, num_warps=4 if consts["BLOCK_E"] >= 1024 else 1,
            **pdl_kwargs(logits.device))
    return ids, weights


# Tokens the fused router takes (each re-reads the router weight, from L2 after the first). H200, one 2048-wide router
# (``gpu_moe.py --router``), fused vs linear + route kernels: gpt-oss-like (32 rows) 2.8 vs 4.1 µs at 1 token, 3.1 vs
# 4.1 at 8; Qwen3-Next-like (64 + 1 rows) 5.0 vs 4.9 at 1 and 2, 5.7 vs 5.2 at 8.
LINEAR_ROUTE_MAX_ROWS = 8
# One router row per program, K in one or two steps: the router is a few hundred KB, so its GEMV is latency-bound;
# 4 rows x 256-wide K steps (the experts' shape) left gpt-oss-like's 32 rows to 8 programs of 8 dependent loads
# (5.8 µs, slower than the linear + route kernels it replaced; 1 x 2048: 2.8 µs, 2 x 1024: 3.1).
_LINEAR_ROUTE = dict(BLOCK_N=1, BLOCK_KD=2048, num_warps=4)


def linear_moe_route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            num_experts: int, router: str, top_k: int, renormalize: bool = False,
                            scaling: float = 1.0, correction_bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_moe_route_ref``'s contract without expert groups, one launch (``_linear_route_kernel``)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"linear_moe_route: x {tuple(x.shape)} / weight {tuple(weight.shape)} need a shared, "
                         f"contiguous last dim")
    num_tokens, n = x.shape[0], weight.shape[0]
    if not num_experts <= n:
        raise ValueError(f"linear_moe_route: {num_experts} experts but {n} router rows")
    if num_tokens > MAX_COUNTERS:
        raise ValueError(f"linear_moe_route_triton: at most {MAX_COUNTERS} tokens, got {num_tokens}")
    scoring = _route_check(num_experts, router=router, top_k=top_k, correction_bias=correction_bias)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    logits = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens:
        _linear_route_kernel[(num_tokens, triton.cdiv(n, _LINEAR_ROUTE["BLOCK_N"]))](
            x, weight, bias if bias is not None else weight, logits, counters(x.device),
            correction_bias if scoring == 2 else logits, ids, weights, x.shape[1], n, num_experts, x.stride(0),
            weight.stride(0), logits.stride(0), ids.stride(0), weights.stride(0), scaling, HAS_BIAS=bias is not None,
            **_route_constexprs(scoring, num_experts, top_k, renormalize, scaling), **_LINEAR_ROUTE,
            **pdl_kwargs(x.device))
    return ids, weights, logits


def linear_moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, num_experts: int,
                     router: str, top_k: int, renormalize: bool = False, scaling: float = 1.0,
                     correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The triton backend's ``linear_moe_route``: the fused kernel for up to ``LINEAR_ROUTE_MAX_ROWS`` tokens
    (routers the route kernel takes), else the backend's ``linear`` then ``moe_route``."""
    if (x.shape[0] <= LINEAR_ROUTE_MAX_ROWS and topk_groups >= num_groups and num_experts <= ROUTE_MAX_EXPERTS
            and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return linear_moe_route_triton(x, weight, bias, num_experts=num_experts, router=router, top_k=top_k,
                                       renormalize=renormalize, scaling=scaling, correction_bias=correction_bias)
    logits = linear(x, weight, bias)
    ids, weights = moe_route(logits[:, :num_experts], router=router, top_k=top_k, renormalize=renormalize,
                             scaling=scaling, correction_bias=correction_bias, num_groups=num_groups,
                             topk_groups=topk_groups)
    return ids, weights, logits


def moe_route(logits: torch.Tensor, *, router: str, top_k: int, renormalize: bool = False, scaling: float = 1.0,
              correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The triton backend's ``moe_route``: the kernel, or the reference for group-limited routing (NemotronH's
    ``topk_groups < num_groups``) and routers wider than ``ROUTE_MAX_EXPERTS``."""
    if topk_groups < num_groups or logits.shape[-1] > ROUTE_MAX_EXPERTS or logits.stride(-1) != 1:
        return moe_route_ref(logits, router=router, top_k=top_k, renormalize=renormalize, scaling=scaling,
                             correction_bias=correction_bias, num_groups=num_groups, topk_groups=topk_groups)
    return moe_route_triton(logits, router=router, top_k=top_k, renormalize=renormalize, scaling=scaling,
                            correction_bias=correction_bias)

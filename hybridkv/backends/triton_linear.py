"""Dense linears for skinny batches (decode: 1-128 rows) in Triton, with the gated activation fused.

At decode sizes a linear layer is a weight stream: each weight is read once and used by a few rows. cuBLAS's
kernels for such shapes leave the copy bandwidth on the table when the output is narrow (a few hundred
output tiles, or fewer than the GPU has SMs) and cost an extra launch for the activation. Here a program owns
BLOCK_N output channels and one K slice (split-K), takes every row as its M tile and streams its weight slice
once; split-K partial tiles go to an fp32 workspace and the last program of a column block (a counter per
block, reset by that program) sums them in a fixed order: deterministic, and no extra launch.

- ``linear_triton``: ``y = x W^T (+ b)`` rounded once to the model dtype (``F.linear``'s contract).
- ``linear_act_mul_triton``: for a packed gate|up weight (2 * inter, K), ``act(gate) * up`` rounded where
  ``act_mul_ref(F.linear(...))`` rounds (gate, act, up, product in the model dtype; fp32 accumulation): the
  gate and up slices of a column block live in the same program, so the (rows, 2 * inter) projection is never
  written.

No host sync, grid from shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.jit_forms import two_forms
from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_fused import _ACT_IDS, _activation, act_mul_triton
from hybridkv.backends.triton_sampling import argmax_triton, first_max, reduce_partials
from hybridkv.layers.ops.fused_ref import linear_ref

__all__ = ["MAX_ROWS", "linear", "linear_act_mul", "linear_act_mul_triton", "linear_argmax", "linear_argmax_triton",
           "linear_triton", "takes"]

MAX_ROWS = 128                      # one M tile; larger batches are compute-bound GEMMs: cuBLAS's regime
# Which calls the backend's ``linear`` ops give the kernel (``takes``; measured on an H100 with the weights
# rotated past the L2): up to 16 rows every projection (cuBLAS's GEMVs are no faster, and a Triton kernel
# between Triton kernels overlaps its launch with theirs, ``pdl.py``); up to 32 rows the projections where
# the kernel was faster (gate|up with the activation fused, down projections with K >= 2 N, vocabulary-size
# heads), cuBLAS for the square-ish q|k|v and o; up to 64 rows small weights (< SMALL_WEIGHT elements, where
# cuBLAS's ~5 µs is launch latency the kernel hides under PDL: the Gemma-3-like q|k|v and o, 44.9 -> 46.4% of
# the roofline at batch 32; the Llama-4-like 12.6 / 8.4 MB ones are faster on cuBLAS, 58.7 vs 55.6%) and
# vocabulary heads; above that cuBLAS's tiles.
ALL_SHAPES_MAX_ROWS = 16
DISPATCH_MAX_ROWS = 32
SMALL_MAX_ROWS = 64
SMALL_WEIGHT = 3 << 20              # elements (6.3 MB in bf16)
_NO_ACT = -1
MAX_COUNTERS = 1 << 16              # arrival counters per device (one per column block of a split-K launch)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters, allocated once per device and shared by the kernels whose last program
    finishes the others' work (split-K here; the MoE router and expert GEMVs, ``triton_moe.py``): each launch's
    last programs re-zero their own, so the next launch, or a captured graph's replay, finds them zero. One
    stream at a time, as the engine runs its steps."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton.jit
def _epilogue(acc, acc_g, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, gate_mult, stride_ym, ty, amax_ptr, amax_idx_ptr,
              write_ptr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MULT: tl.constexpr,
              ARGMAX: tl.constexpr, WRITE_FLAG: tl.constexpr):
    """Rounds where ``F.linear`` / ``act_mul_ref`` round (to ``ty``, the model dtype), stores in y's dtype
    (with ``WRITE_FLAG``, only if the scalar at ``write_ptr`` is nonzero); with ``ARGMAX`` also each row's
    first maximum over this column block (``triton_sampling``'s partials, (M, column blocks) at ``amax_ptr`` /
    ``amax_idx_ptr``), taken from the values as stored."""
    if HAS_BIAS:                                         # gated: gate biases [0, N), up biases [N, 2N)
        if GATED:
            acc += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(ty).to(tl.float32)
    if GATED:
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        g = acc_g.to(ty).to(tl.float32)
        if HAS_MULT:
            g = (g * gate_mult).to(ty).to(tl.float32)
        y = _activation(g, ACT).to(ty).to(tl.float32) * y
    elif ACT >= 0:
        y = _activation(y, ACT)
    y = y.to(ty)
    store_ok = m_ok[:, None] & n_ok[None, :]
    if WRITE_FLAG:                                       # the flag as a tensor: the interpreter masks no scalars
        store_ok = store_ok & (tl.load(write_ptr + 0 * rn) != 0)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=store_ok)
    if ARGMAX:
        best, first = first_max(y.to(tl.float32), rn[None, :], n_ok[None, :], 1)
        part = rm * tl.num_programs(0) + tl.program_id(0)
        tl.store(amax_ptr + part, best, mask=m_ok)
        tl.store(amax_idx_ptr + part, first, mask=m_ok)


def _skinny_linear(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, amax_ptr, amax_idx_ptr, write_ptr, M, N, K, gate_mult,
    stride_xm, stride_wn, stride_ym, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MULT: tl.constexpr, ARGMAX: tl.constexpr, WRITE_FLAG: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    pdl_wait(PDL)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm                    # (BLOCK_M, 1)
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn                    # (1, BLOCK_N): W^T's columns
    if GATED:  # noqa: SIM108  (constexpr branch)                            # up rows follow the gate's
        up_cols = w_ptr + (N + rn)[None, :].to(tl.int64) * stride_wn
    else:
        up_cols = w_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # (BLOCK_M, BLOCK_K)
        wm = k_ok[:, None] & n_ok[None, :]         # W^T tiles (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, tl.load(up_cols + kk[:, None], mask=wm, other=0.0), acc, input_precision="ieee")
        if GATED:
            acc_g = tl.dot(a, tl.load(w_cols + kk[:, None], mask=wm, other=0.0), acc_g, input_precision="ieee")
    if SPLIT_K == 1:
        _epilogue(acc, acc_g, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, gate_mult, stride_ym, x_ptr.dtype.element_ty,
                  amax_ptr, amax_idx_ptr, write_ptr, ACT, GATED, HAS_BIAS, HAS_MULT, ARGMAX, WRITE_FLAG)
    else:
        # part: (SPLIT_K, 2 if GATED else 1, BLOCK_M, N) fp32 partial tiles
        width = N + 0 * pid_n.to(tl.int64)             # int64 offsets (N may be specialised to a constant)
        tile = rm[:, None].to(tl.int64) * width + rn[None, :]
        n_parts: tl.constexpr = 2 if GATED else 1
        mine = part_ptr + pid_k * (n_parts * BLOCK_M) * width
        tl.store(mine + tile, acc, mask=n_ok[None, :])
        if GATED:
            tl.store(mine + BLOCK_M * width + tile, acc_g, mask=n_ok[None, :])
        tl.debug_barrier()                              # every thread's partial issued before the release
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):                     # fixed order: the same sums whichever program is last
                src = part_ptr + s * (n_parts * BLOCK_M) * width
                acc += tl.load(src + tile, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_g += tl.load(src + BLOCK_M * width + tile, mask=n_ok[None, :], other=0.0,
                                     cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)              # ready for the next launch (or graph replay)
            _epilogue(acc, acc_g, b_ptr, y_ptr, rm, rn, m_ok, n_ok, N, gate_mult, stride_ym,
                      x_ptr.dtype.element_ty, amax_ptr, amax_idx_ptr, write_ptr, ACT, GATED, HAS_BIAS, HAS_MULT,
                      ARGMAX, WRITE_FLAG)


_SMEM_BUDGET = 160 * 1024          # bytes of pipelined tiles per program (an H100 SM has 228 KiB)


# rows change per step (the graph form knows its bucket's); BLOCK_M's classes are built by the start-up warm-up
_skinny_linear_kernel = two_forms(_skinny_linear, per_step=["M"])


def default_config(rows: int, n: int, k: int, *, gated: bool, itemsize: int = 2) -> dict:
    """Tiles for a (rows x k) @ (k x n) product (n output channels; gated: per half), the best of an H100
    sweep over tile shapes, splits, warps and stages: 32-channel column blocks (64 for vocabulary-size outputs,
    and for gate|up above 16 rows: 13.9 vs 15.0 µs for the Gemma-3-like one at 32 rows, equal at 1),
    128-deep K tiles, and split-K until there are ~256 weight tiles of 32 channels in flight or a slice
    would drop under 512 input features."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_n = 64 if (n > 16384 and not gated) or (gated and rows > 16) else 32
    block_k = 128
    tiles = triton.cdiv(n, 32) * (2 if gated else 1)
    split = 1
    while tiles * split < 256 and split < 8 and k // (2 * split) >= 512:
        split *= 2
    b_tiles = 2 if gated else 1
    while True:
        stages = min(4, _SMEM_BUDGET // ((block_m + b_tiles * block_n) * block_k * itemsize))
        if stages >= 2 or block_k <= 32:
            break
        block_k //= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
                num_stages=max(1, stages))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, n: int, act: int, gated: bool,
            gate_multiplier: float, out_dtype: torch.dtype | None = None,
            argmax: tuple[torch.Tensor, torch.Tensor] | None = None,
            write_logits: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax``: (rows, column blocks) fp32 / int32 tensors for the epilogue's argmax partials;
    ``write_logits``: a device scalar, y is stored only where it is nonzero."""
    rows, k = x.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("linear_triton: x and weight need a contiguous last dim")
    if weight.shape[1] != k:
        raise ValueError(f"linear_triton: x has {k} input features, weight {tuple(weight.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"linear_triton: at most {MAX_ROWS} rows (one M tile), got {rows}")
    y = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    cfg = default_config(rows, n, k, gated=gated, itemsize=x.element_size())
    split = cfg.pop("SPLIT_K")
    column_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1 and column_blocks > MAX_COUNTERS:
        raise ValueError(f"linear_triton: split-K over {column_blocks} column blocks (at most {MAX_COUNTERS})")
    part = (torch.empty(split, 2 if gated else 1, cfg["BLOCK_M"], n, dtype=torch.float32, device=x.device)
            if split > 1 else y)
    amax, amax_idx = argmax if argmax is not None else (y, y)
    if argmax is not None and amax.shape != (rows, column_blocks):
        raise ValueError(f"linear_triton: argmax partials of shape {tuple(amax.shape)}, expected "
                         f"{(rows, column_blocks)}")
    _skinny_linear_kernel.pick(x)[(column_blocks, split)](
        x, weight, bias if bias is not None else weight, y, part, counters(x.device), amax, amax_idx,
        write_logits if write_logits is not None else y, rows, n, k, gate_multiplier, x.stride(0), weight.stride(0),
        y.stride(0), ACT=act, GATED=gated, HAS_BIAS=bias is not None, HAS_MULT=gate_multiplier != 1.0,
        ARGMAX=argmax is not None, WRITE_FLAG=write_logits is not None, SPLIT_K=split, **cfg, **pdl_kwargs(x.device))
    return y


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (rows <= MAX_ROWS, K), weight (N, K), bias (N,) or None -> (rows, N) rounded to x's dtype, stored in
    ``out_dtype`` (default: x's)."""
    return _launch(x, weight, bias, n=weight.shape[0], act=_NO_ACT, gated=False, gate_multiplier=1.0,
                   out_dtype=out_dtype)


def linear_argmax_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         out: torch.Tensor | None = None, write_logits: torch.Tensor | None = None,
                         report: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_argmax_ref``: fp32 logits (rows, N) as ``linear_triton(..., out_dtype=fp32)`` and each row's
    argmax (rows,) int64 (into ``out`` when given): the kernel's epilogue leaves a first maximum per column
    block, and one short launch picks among them (``triton_sampling``); the logits are not read again. With
    ``write_logits`` (a device scalar) the logits are stored only where it is nonzero: a captured greedy step
    whose caller needs only the tokens skips their (rows x N x 4)-byte write."""
    rows, n = x.shape[0], weight.shape[0]
    if n == 0:
        raise ValueError("linear_argmax: empty vocabulary")
    blocks = triton.cdiv(n, default_config(rows, n, x.shape[1], gated=False, itemsize=x.element_size())["BLOCK_N"])
    values = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, blocks, dtype=torch.int32, device=x.device)
    logits = _launch(x, weight, bias, n=n, act=_NO_ACT, gated=False, gate_multiplier=1.0, out_dtype=torch.float32,
                     argmax=(values, indices), write_logits=write_logits)
    return logits, reduce_partials(values, indices, out=out, report=report)


def linear_act_mul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          activation: str, gated: bool = True, gate_multiplier: float = 1.0) -> torch.Tensor:
    """``act_mul_ref(F.linear(x, weight, bias), ...)``: weight (2 * inter, K) packed gate|up when gated, else
    (inter, K) -> (rows, inter)."""
    if activation not in _ACT_IDS:
        raise ValueError(f"linear_act_mul: unknown activation {activation!r}; known: {sorted(_ACT_IDS)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"linear_act_mul: a gated weight has an even row count (gate|up), got {weight.shape[0]}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return _launch(x, weight, bias, n=n, act=_ACT_IDS[activation], gated=gated, gate_multiplier=gate_multiplier)


def dispatch_description() -> str:
    return (f"Triton up to {ALL_SHAPES_MAX_ROWS} rows, up to {DISPATCH_MAX_ROWS} for gate|up and down projections, up "
            f"to {SMALL_MAX_ROWS} for small weights and vocabulary projections, cuBLAS above")


def takes(rows: int, n_out: int, k: int, *, gated: bool) -> bool:
    """Whether the backend's ops run a (rows x k) @ (k x n_out) projection on the kernel (see the rule above)."""
    if rows <= ALL_SHAPES_MAX_ROWS:
        return rows > 0
    if rows <= DISPATCH_MAX_ROWS and (gated or k >= 2 * n_out):
        return True
    return rows <= SMALL_MAX_ROWS and (n_out * k * (2 if gated else 1) < SMALL_WEIGHT or n_out > 16384)


def _kernel_fits(x: torch.Tensor, weight: torch.Tensor, *, gated: bool) -> bool:
    """A half-precision CUDA input the dispatch rule gives the kernel (fp32 models keep cuBLAS's fp32 GEMM)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and takes(x.shape[0], weight.shape[0] // (2 if gated else 1), x.shape[1], gated=gated))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The triton backend's ``linear`` (``linear_ref``'s contract): the kernel at decode sizes, else cuBLAS."""
    if _kernel_fits(x, weight, gated=False):
        return linear_triton(x, weight, bias, out_dtype=out_dtype)
    return linear_ref(x, weight, bias, out_dtype=out_dtype)           # cuBLAS


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, write_logits: torch.Tensor | None = None,
                  report: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The triton backend's ``linear_argmax`` (``linear_argmax_ref``'s contract): the argmax inside the
    kernel's epilogue at decode sizes (``write_logits`` honoured), else cuBLAS's logits and ``argmax_triton``."""
    if _kernel_fits(x, weight, gated=False):
        return linear_argmax_triton(x, weight, bias, out=out, write_logits=write_logits, report=report)
    logits = linear_ref(x, weight, bias, out_dtype=torch.float32)
    return logits, argmax_triton(logits, out=out, report=report)


def linear_act_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str,
                   gated: bool = True, gate_multiplier: float = 1.0) -> torch.Tensor:
    """The triton backend's ``linear_act_mul`` (``linear_act_mul_ref``'s contract): one kernel at decode sizes,
    else cuBLAS and the fused ``act_mul`` kernel."""
    if _kernel_fits(x, weight, gated=gated):
        return linear_act_mul_triton(x, weight, bias, activation=activation, gated=gated,
                                     gate_multiplier=gate_multiplier)
    return act_mul_triton(torch.nn.functional.linear(x, weight, bias), activation=activation, gated=gated,
                          gate_multiplier=gate_multiplier)

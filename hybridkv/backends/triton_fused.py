"""Triton kernels for the elementwise work between a layer's GEMMs: one launch where the torch references
(``layers/ops/fused_ref.py``, same signatures) run 5-30 small kernels. At decode batch sizes a step is made of
such launches, so their number, not their bytes, sets the step time.

- ``add_rms_norm`` / ``rms_norm``: one program per row: optional post-norm of the branch output, residual
  multiplier, residual add, the next pre-norm (RMS, Gemma's or a bias-free LayerNorm); fp32 math with the
  reference's rounding points.
- ``act_mul``: ``act(gate) * up`` over the packed gate|up projection or a gate and a separate up (silu, gelu,
  gelu_tanh, relu2, sigmoid).
- ``qk_rope_write_kv``: one program per token, all its heads as one (heads, head_dim) tile: q/k norm, RoPE
  (rotate-half or interleaved, partial), post-RoPE norm or NoPE temperature, then q out and K/V into the
  paged cache (negative slot: padding, not written).
- ``gated_rms_norm``: one program per (token, group), or per (rows, group) for many short groups: Mamba2's
  ``norm(y * silu(z))``.

All grids depend on shapes only and nothing syncs, so they capture in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.layers.ops.fused_ref import QKPrep

__all__ = ["act_mul_triton", "add_rms_norm_triton", "gated_rms_norm_triton", "qk_rope_write_kv_triton",
           "rms_norm_triton"]

_ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu2": 3, "sigmoid": 5}     # 4: the MoE kernels' swiglu_oai


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


_MANY_ROWS = 4096      # (row, group) programs from which ``gated_rms_norm`` packs several rows into one


def _warps(block: int) -> int:
    """One warp per 256 elements of a row: 8 at hidden 1152-2048, the best on an H100 or within 0.15 µs of it
    (fewer warps leave the row's loads serial: 1 warp was 0.5-1.5 µs slower per launch)."""
    return max(1, min(16, block // 256))


@triton.jit
def _normalize(x, mask, n, eps, CENTER: tl.constexpr = False):
    """x / rms(x) over the valid (``mask``) entries of a 1-D fp32 block of n values; CENTER: (x - mean) / std
    (a LayerNorm without bias)."""
    if CENTER:
        x = tl.where(mask, x - tl.sum(tl.where(mask, x, 0.0), 0) / n, 0.0)
    ms = tl.sum(tl.where(mask, x * x, 0.0), 0) / n
    return x * (1.0 / tl.sqrt(ms + eps))


@triton.jit
def _scale_weight(normed, w_ptr, offs, mask, GEMMA: tl.constexpr, IN_TY: tl.constexpr, OUT_TY: tl.constexpr,
                  CENTER: tl.constexpr = False):
    """The RMSNorm weight step, rounded as ``rms_norm_ref`` for an input of dtype IN_TY: Gemma
    (normed * (1 + w)).to(IN_TY), centered (normed * w).to(IN_TY), plain w * normed.to(IN_TY) in OUT_TY (the
    promotion of IN_TY and w's)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        return (normed * (1.0 + w)).to(IN_TY)
    if CENTER:
        return (normed * w).to(IN_TY)
    return (normed.to(IN_TY).to(tl.float32) * w).to(OUT_TY)


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr, res_ptr, res_out_ptr, out_ptr, w_ptr, dw_ptr, n, eps, scale,
    stride_d, stride_r, stride_ro, stride_o,
    HAS_DELTA: tl.constexpr, HAS_DELTA_W: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
    GEMMA: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False, CENTER: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    res_ty = res_out_ptr.dtype.element_ty
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d_ty = delta_ptr.dtype.element_ty
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA_W:
            d = _scale_weight(_normalize(d, mask, n, eps, CENTER), dw_ptr, offs, mask, GEMMA, d_ty, d_ty,
                              CENTER).to(tl.float32)
        if HAS_SCALE:
            d = (d * scale).to(d_ty).to(tl.float32)
        r = (r + d).to(res_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, r, mask=mask)
    if HAS_NORM:
        out_ty = out_ptr.dtype.element_ty
        if HAS_DELTA:  # noqa: SIM108  (a static branch; the norm reads the residual in the weight dtype, else x)
            in_ty = w_ptr.dtype.element_ty
        else:
            in_ty = res_ptr.dtype.element_ty
        x = r.to(in_ty).to(tl.float32)
        y = _scale_weight(_normalize(x, mask, n, eps, CENTER), w_ptr, offs, mask, GEMMA, in_ty, out_ty, CENTER)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what}: expected (num_tokens, hidden) with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    return x


def add_rms_norm_triton(delta: torch.Tensor, residual: torch.Tensor, *, weight: torch.Tensor | None, eps: float,
                        gemma: bool = False, delta_weight: torch.Tensor | None = None, scale: float = 1.0,
                        centered: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Same contract as ``add_rms_norm_ref``."""
    _rows(delta, "add_rms_norm delta")
    _rows(residual, "add_rms_norm residual")
    if delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} vs residual {tuple(residual.shape)}")
    if delta_weight is not None and delta_weight.dtype != delta.dtype:
        raise ValueError(f"add_rms_norm: the post-norm weight ({delta_weight.dtype}) must have the branch "
                         f"output's dtype ({delta.dtype})")
    rows, n = residual.shape
    res_out = torch.empty_like(residual)
    out = torch.empty(rows, n, dtype=weight.dtype, device=residual.device) if weight is not None else res_out
    if rows:
        block = _pow2(n)
        _add_rms_norm_kernel[(rows,)](
            delta, residual, res_out, out, weight if weight is not None else residual,
            delta_weight if delta_weight is not None else residual, n, eps, scale,
            delta.stride(0), residual.stride(0), res_out.stride(0), out.stride(0),
            HAS_DELTA=True, HAS_DELTA_W=delta_weight is not None, HAS_SCALE=scale != 1.0,
            HAS_NORM=weight is not None, GEMMA=gemma, BLOCK=block, num_warps=_warps(block), CENTER=centered,
            **pdl_kwargs(delta.device))
    return (out if weight is not None else None), res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, *, eps: float, gemma: bool = False,
                    centered: bool = False) -> torch.Tensor:
    """Same contract as ``rms_norm_ref`` for (num_tokens, hidden) inputs."""
    _rows(x, "rms_norm x")
    rows, n = x.shape
    out_dtype = x.dtype if gemma or centered else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    if rows:
        block = _pow2(n)
        _add_rms_norm_kernel[(rows,)](
            x, x, x, out, weight, weight, n, eps, 1.0, x.stride(0), x.stride(0), x.stride(0), out.stride(0),
            HAS_DELTA=False, HAS_DELTA_W=False, HAS_SCALE=False, HAS_NORM=True, GEMMA=gemma, BLOCK=block,
            num_warps=_warps(block), CENTER=centered, **pdl_kwargs(x.device))
    return out


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:
        return x / (1.0 + tl.exp(-x))
    elif ACT == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACT == 5:
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        r = tl.maximum(x, 0.0)
        return r * r


@triton.jit
def _act_mul_kernel(
    x_ptr, up_ptr, out_ptr, inter, gate_mult, stride_x, stride_up, stride_o,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_MULT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    ty = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        if HAS_MULT:
            g = (g * gate_mult).to(ty).to(tl.float32)
        a = _activation(g, ACT).to(ty).to(tl.float32)
        u = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0).to(tl.float32)
        y = a * u
    else:
        y = _activation(g, ACT)
    tl.store(out_ptr + row * stride_o + offs, y.to(ty), mask=mask)


def act_mul_triton(x: torch.Tensor, *, activation: str, gated: bool = True, gate_multiplier: float = 1.0,
                   up: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``act_mul_ref`` (x and ``up`` may be strided views: rows of a wider tensor)."""
    _rows(x, "act_mul x")
    if activation not in _ACT_IDS:
        raise ValueError(f"act_mul: unknown activation {activation!r}; known: {sorted(_ACT_IDS)}")
    rows, width = x.shape
    if up is not None and (not gated or _rows(up, "act_mul up").shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"act_mul: up must be a gated input's ({rows}, {width}) {x.dtype}, got "
                         f"{tuple(up.shape)} {up.dtype} (gated={gated})")
    if gated and up is None and width % 2:
        raise ValueError(f"act_mul: a gated input has an even width (gate|up), got {width}")
    inter = width // 2 if gated and up is None else width
    if up is None:               # packed gate|up: up is the second half of x's row
        up = x[:, inter:]
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows and inter:
        block = min(1024, _pow2(inter))
        _act_mul_kernel[(rows, triton.cdiv(inter, block))](
            x, up, out, inter, gate_multiplier, x.stride(0), up.stride(0), out.stride(0), ACT=_ACT_IDS[activation],
            GATED=gated, HAS_MULT=gate_multiplier != 1.0, BLOCK=block, num_warps=_warps(block),
            **pdl_kwargs(x.device))
    return out


@triton.jit
def _prep_heads(row_ptr, stride_h, n_heads, w_ptr, pos, inv_freq_ptr, eps, attn_scale, floor_scale, ty,
                HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, ROT_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr, POST_NORM: tl.constexpr, GEMMA: tl.constexpr,
                TEMPERATURE: tl.constexpr):
    """One token's heads (HEADS_P, HEAD_DIM_P) as fp32 values already rounded to ``ty``: per-head norm, RoPE,
    post-RoPE norm, temperature, in ``qk_rope_write_kv_ref``'s order and rounding."""
    hh = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    ok = (hh < n_heads) & (d < HEAD_DIM)
    ptrs = row_ptr + hh * stride_h
    x = tl.load(ptrs + d, mask=ok, other=0.0).to(tl.float32)
    if ROT_DIM > 0:
        rot = ok & (d < ROT_DIM)
        if INTERLEAVED:
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
            fi = d // 2
        else:
            partner = tl.where(d < ROT_DIM // 2, d + ROT_DIM // 2, d - ROT_DIM // 2)
            sign = tl.where(d < ROT_DIM // 2, -1.0, 1.0)
            fi = d % (ROT_DIM // 2)
        xp = tl.load(ptrs + partner, mask=rot, other=0.0).to(tl.float32)
    if QK_NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = _scale_weight(x * inv, w_ptr, d, d < HEAD_DIM, GEMMA, ty, ty).to(tl.float32)
        if ROT_DIM > 0:
            xp = _scale_weight(xp * inv, w_ptr, partner, d < ROT_DIM, GEMMA, ty, ty).to(tl.float32)
    if ROT_DIM > 0:
        theta = pos * tl.load(inv_freq_ptr + fi, mask=d < ROT_DIM, other=0.0)     # fp32, as the reference
        # Reduce to [-pi, pi] in fp64 first: the angle reaches ~1e6 rad at long contexts, where a fast sin/cos
        # would be wrong; the reduced fp32 angle has the same sin/cos to ~1e-7.
        t64 = theta.to(tl.float64)
        theta = (t64 - 6.283185307179586 * tl.floor(t64 * 0.15915494309189535 + 0.5)).to(tl.float32)
        roped = x * tl.cos(theta) + sign * xp * tl.sin(theta)
        x = tl.where(rot, roped.to(ty).to(tl.float32), x)
        if POST_NORM:
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
            x = (x * inv).to(ty).to(tl.float32)
    if TEMPERATURE:
        x = (x * (1.0 + attn_scale * tl.log(1.0 + tl.floor((pos + 1.0) / floor_scale)))).to(ty).to(tl.float32)
    return x


@triton.jit
def _qk_rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_heads, num_kv_heads, q_programs, eps, attn_scale, floor_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HEADS_P: tl.constexpr,
    ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr, POST_NORM: tl.constexpr,
    GEMMA: tl.constexpr, TEMPERATURE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (tokens, q_programs + kv programs): program j < q_programs writes HEADS_P of the token's q heads
    out, a later one puts HEADS_P of its k and v heads into the cache (short dependent chains side by side
    instead of one long one per token: decode batches have few tokens)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ty = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.float32)
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    if j < q_programs:
        h0 = j * HEADS_P
        q = _prep_heads(q_ptr + t * stride_qt + h0 * stride_qh, stride_qh, num_heads - h0, qw_ptr, pos,
                        inv_freq_ptr, eps, attn_scale, floor_scale, ty, HEADS_P, HEAD_DIM, HEAD_DIM_P, ROT_DIM,
                        INTERLEAVED, QK_NORM, POST_NORM, GEMMA, TEMPERATURE)
        qh = h0 + tl.arange(0, HEADS_P)[:, None]
        tl.store(q_out_ptr + t * stride_ot + qh * stride_oh + d, q.to(ty), mask=(qh < num_heads) & (d < HEAD_DIM))
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h0 = (j - q_programs) * HEADS_P
            k = _prep_heads(k_ptr + t * stride_kt + h0 * stride_kh, stride_kh, num_kv_heads - h0, kw_ptr, pos,
                            inv_freq_ptr, eps, attn_scale, floor_scale, ty, HEADS_P, HEAD_DIM, HEAD_DIM_P,
                            ROT_DIM, INTERLEAVED, QK_NORM, POST_NORM, GEMMA, False)
            kh = h0 + tl.arange(0, HEADS_P)[:, None]
            ok = (kh < num_kv_heads) & (d < HEAD_DIM)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + kh * stride_kch + d,
                     k.to(k_cache_ptr.dtype.element_ty), mask=ok)
            v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + d, mask=ok, other=0.0)
            tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + kh * stride_vch + d,
                     v.to(v_cache_ptr.dtype.element_ty), mask=ok)


_QK_ELEMS = 256    # head elements per program of ``_qk_rope_kv_kernel`` (whole heads, at least one)


def qk_rope_write_kv_triton(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (num_tokens,)
    *,
    prep: QKPrep,
    inv_freq: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,); < 0 = padding, not written
) -> torch.Tensor:
    """Same contract as ``qk_rope_write_kv_ref`` (plus: negative slots are skipped). k and v None (a KV-sharing
    layer): only the q programs run."""
    if (k is None) != (v is None):
        raise ValueError("qk_rope_write_kv: k and v are both given or both None")
    q_only = k is None
    if q_only:      # no k program is launched: k / v stand for pointers never read
        k = v = q[:, :k_cache.shape[2]]
        k_norm_weight = q_norm_weight
    args = qk_prep_arguments(q, k, v, positions, prep=prep, inv_freq=inv_freq, q_norm_weight=q_norm_weight,
                             k_norm_weight=k_norm_weight, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    n, heads, d = q.shape
    kv_heads = 0 if q_only else k.shape[1]
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    heads_p = min(_pow2(max(heads, kv_heads)), max(1, _QK_ELEMS // _pow2(d)))
    q_programs = -(-heads // heads_p)
    _qk_rope_kv_kernel[(n, q_programs + -(-kv_heads // heads_p))](
        q_ptr=q, k_ptr=k, v_ptr=v, q_out_ptr=out, k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        num_heads=heads, num_kv_heads=kv_heads, q_programs=q_programs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_kcb=k_cache.stride(0), stride_kcs=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcb=v_cache.stride(0), stride_vcs=v_cache.stride(1), stride_vch=v_cache.stride(2),
        HEAD_DIM=d, HEAD_DIM_P=_pow2(d), HEADS_P=heads_p, BLOCK_SIZE=k_cache.shape[1],
        num_warps=max(1, min(4, heads_p * _pow2(d) // 128)), **args, **pdl_kwargs(q.device))
    return out


def qk_prep_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, prep: QKPrep,
                      inv_freq: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
                      k_norm_weight: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> dict:
    """Checks ``qk_rope_write_kv``'s inputs; returns the launch arguments of ``_prep_heads``'s callers (the
    tensors and constants of ``prep``) by their kernel parameter names."""
    n, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or slot_mapping.shape[0] != n:
        raise ValueError(f"qk_rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    if positions.shape[0] != n:
        raise ValueError(f"qk_rope_write_kv: positions {tuple(positions.shape)} for {n} tokens")
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    if d != prep.head_dim:
        raise ValueError(f"qk_rope_write_kv: head_dim {d} != prep.head_dim {prep.head_dim}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("qk_rope_write_kv: the head_dim axis must be contiguous (stride 1)")
    norm = prep.qk_norm == "rms"
    if norm and (q_norm_weight is None or k_norm_weight is None):
        raise ValueError("qk_rope_write_kv: qk_norm='rms' needs q_norm_weight and k_norm_weight")
    if norm and not q_norm_weight.dtype == k_norm_weight.dtype == q.dtype == k.dtype:
        raise ValueError("qk_rope_write_kv: q/k and their norm weights must share one dtype")
    if prep.rot_dim and inv_freq is None:
        raise ValueError("qk_rope_write_kv: RoPE needs inv_freq")
    temperature = prep.rot_dim == 0 and prep.temperature_tuning is not None
    attn_scale, floor_scale = prep.temperature_tuning if temperature else (0.0, 1.0)
    return dict(pos_ptr=positions, inv_freq_ptr=inv_freq if prep.rot_dim else positions,
                qw_ptr=q_norm_weight if norm else positions, kw_ptr=k_norm_weight if norm else positions,
                slot_ptr=slot_mapping, eps=prep.eps, attn_scale=attn_scale, floor_scale=floor_scale,
                ROT_DIM=prep.rot_dim, INTERLEAVED=prep.interleaved, QK_NORM=norm,
                POST_NORM=prep.rot_dim > 0 and prep.qk_norm == "rms_weightless", GEMMA=prep.gemma_norm,
                TEMPERATURE=temperature)


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, rows, group_size, eps, stride_y, stride_z, stride_o,
    HAS_NORM: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]          # (ROWS, 1)
    cols = tl.arange(0, BLOCK)
    offs = (tl.program_id(1) * group_size + cols)[None, :]                              # (1, BLOCK)
    mask = (row < rows) & (cols < group_size)[None, :]
    ty = out_ptr.dtype.element_ty
    in_ty = y_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    if not HAS_NORM:
        out = (y * gate).to(ty)
    else:
        w = tl.load(w_ptr + offs, mask=(cols < group_size)[None, :], other=0.0).to(tl.float32)
        x = y if NORM_BEFORE_GATE else y * gate
        x = x * (1.0 / tl.sqrt(tl.sum(tl.where(mask, x * x, 0.0), 1) / group_size + eps))[:, None]
        if NORM_BEFORE_GATE:  # noqa: SIM108  (constexpr branch)
            out = (w * x * gate).to(ty)
        else:
            out = (x.to(in_ty).to(tl.float32) * w).to(ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, *, n_groups: int = 1,
                          eps: float = 1e-5, norm_before_gate: bool = False) -> torch.Tensor:
    """Same contract as ``gated_rms_norm_ref``."""
    _rows(y, "gated_rms_norm y")
    _rows(z, "gated_rms_norm z")
    rows, dim = y.shape
    if z.shape != y.shape or dim % n_groups:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)}, z {tuple(z.shape)}, n_groups {n_groups}")
    groups = n_groups if weight is not None else max(1, dim // 1024)
    while dim % groups:     # without a norm any split works: keep blocks <= ~1024 channels
        groups += 1
    plain = weight is not None and not norm_before_gate
    out_dtype = torch.promote_types(y.dtype, weight.dtype) if plain else y.dtype   # as the reference's
    out = torch.empty(rows, dim, dtype=out_dtype, device=y.device)
    if rows:
        block = _pow2(dim // groups)
        # short groups (a DeltaNet head: 128) of a prefill: many rows a program, not 100k one-warp programs
        # (Qwen3-Next-like, 8192 tokens x 32 heads: 316 µs a layer with one row each on an H200)
        per = 1 if rows * groups < _MANY_ROWS else max(1, 2048 // block)
        _gated_rms_norm_kernel[(triton.cdiv(rows, per), groups)](
            y, z, weight if weight is not None else y, out, rows, dim // groups, eps, y.stride(0), z.stride(0),
            out.stride(0), HAS_NORM=weight is not None, NORM_BEFORE_GATE=norm_before_gate, ROWS=per, BLOCK=block,
            num_warps=_warps(per * block), **pdl_kwargs(y.device))
    return out

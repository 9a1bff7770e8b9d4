"""Triton paged attention (one kernel for prefill, decode and mixed batches) and the KV write by slot.

Signatures are those of the references ``paged_attention_ref`` / ``write_kv_ref`` (plus optional
keyword arguments), so the ``triton`` backend is a drop-in replacement checked against them.

Kernel design (``_paged_attention_kernel``):

- grid = (q-blocks, num_kv_heads, num_segments). A q-block is ``BLOCK_Q`` consecutive query tokens of one
  request; with ``G = num_heads // num_kv_heads`` query heads per KV head, its ``BLOCK_M = BLOCK_Q * G``
  (padded to a power of two) rows are (token, head-in-group) pairs, so one K/V tile read from memory serves
  every query head of the group (GQA packing) and a decode token still fills a tensor-core tile.
  Request r owns q-blocks ``qsl[r] // BLOCK_Q + r ..`` (a monotone index, found by ``find_request`` over
  ``query_start_loc`` inside the kernel), so the grid size depends on (num_tokens, num_reqs) only: no host
  work per request, no device->host sync, and a fixed grid under CUDA graphs.
- keys are visited in tiles of ``TILE`` consecutive positions; each key's physical slot is looked up through
  the block table (``block_table[r, k // block_size]``, ``k % block_size``), so ANY block size works (1, 3,
  16, 256, ...) and the caches may be strided views (the pool keeps K and V of a block side by side).
- only the tiles a q-block can see are visited: ``[first_q - W + 1, last_q]`` (causal + window), and loads
  are masked to that range, so a block the metadata does not reference (NaN-poisoned in the tests, or
  freed and reused) is never read. Positions are relative to ``key_start``: trimmed sliding-window tables
  and local-attention virtual batches need nothing special.
- fp32 scores and accumulator, online softmax in base 2; softcap ``c * tanh(s / c)`` on the scaled logits.
- attention sinks (``HAS_SINKS``, gpt-oss): the head's sink logit joins the softmax once per query row: as the
  running (max, sum) a row starts from, (sink, 1), when the row is not split; in the reduction (as one more
  "segment" with a max and a sum but no accumulator) when it is; no key tile ever sees it. Without sinks the
  constexpr removes every trace of it from both kernels.
- split-KV ("flash decoding"): when (q-blocks x kv heads) cannot fill the GPU (small-batch decode), the
  visible key tiles are split over ``num_segments`` programs that write unnormalised partials (acc, max,
  sum); ``_reduce_segments_kernel`` combines them. With one segment the kernel writes the output directly.
  (Why a second launch: merging in the last segment to finish, as the split-K linear does, was slower on an
  H100, 6.1 -> 14.3 µs at batch 1 with 32 segments: one program merging the partials serially costs more
  than a launch under PDL.)
- decode-only batches (``max_query_len <= 1``, which the metadata guarantees) map program i to request i
  and visit their keys in one masked loop; other batches find a program's request by counting keys
  (``find_request``: one load per 128 requests) and split the loop into window front, unmasked middle and diagonal.
- ``rope_attention_triton`` on a decode batch (``PREP``): q, k and v arrive as projected. Each program
  prepares its own q rows (q/k norm, RoPE or NoPE temperature, ``triton_fused._prep_heads``), and the one
  program per (request, KV head) whose key range holds the new key prepares it and writes it and v at the
  token's slot before its loop reads the cache: no separate ``qk_rope_write_kv`` launch.
- PDL: a split decode batch loads its metadata and computes its key range before ``pdl_wait`` (the exception to
  ``backends/pdl.py``'s rule: no kernel of a step writes ``query_start_loc`` or ``seq_lens``); everything else,
  and any exit, comes after it.

``write_kv`` is one launch: one program per token writes its K and V rows (all KV heads) at the slot;
a negative slot (padding) is skipped.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from hybridkv.backends.base import UnsupportedConfig
from hybridkv.backends.jit_forms import capturing, two_forms
from hybridkv.backends.pdl import pdl_kwargs, pdl_wait
from hybridkv.backends.triton_fused import _prep_heads, qk_prep_arguments, qk_rope_write_kv_triton
from hybridkv.layers.ops.fused_ref import QKPrep
from hybridkv.metadata import CommonAttentionMetadata

__all__ = ["MAX_HEAD_DIM", "find_request", "launch_config", "paged_attention_triton",
           "rope_attention_triton", "shared_memory_bound", "write_kv_triton"]

_LOG2E = 1.4426950408889634
_MAX_SEGMENTS = 128


@triton.jit
def find_request(qsl_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """Largest r with qsl[r] // BLOCK_Q + r <= pid: the request whose BLOCK_Q-token blocks program ``pid`` of a
    packed-varlen grid works on (also used by the conv1d kernel). The key rises strictly from 0, so r + 1 is the
    number of keys <= pid, counted 128 at a time: one load per 128 requests up to r, fewer dependent loads than a
    binary search's ~log2(requests) below ~1200 requests (a mixed graph's layouts: ``docs/design.md``)."""
    count = pid * 0
    start = pid * 0
    more = num_reqs > 0
    while more:
        r = start + tl.arange(0, 128)
        ok = r < num_reqs
        n = tl.sum((ok & (tl.load(qsl_ptr + r, mask=ok, other=0) // BLOCK_Q + r <= pid)).to(tl.int32), 0)
        count += n
        start += 128
        more = (n == 128) & (start < num_reqs)
    return count - 1


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_base, v_base, bt_row, t_start, t_end, key_lo, key_hi, q_pos, row_ok,
    stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online-softmax update over key tiles [t_start, t_end). MASKED=False: every key of these tiles is
    visible to every row (the caller proved it), so loads and scores skip the masks."""
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    qk_scale = scale * 1.4426950408889634                  # base-2 softmax
    for t in range(t_start, t_end):
        k_pos = t * TILE + offs_t
        if MASKED:
            k_ok = (k_pos >= key_lo) & (k_pos < key_hi)
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        off = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (blk * stride_kb + off * stride_ks)[None, :] + offs_d[:, None]
        v_ptrs = v_base + (blk * stride_vb + off * stride_vs)[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)       # (HEAD_DIM_P, TILE)
        elif HEAD_DIM_P != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, k, input_precision=PRECISION)                                   # (BLOCK_M, TILE) fp32
        if USE_SOFTCAP:
            x = s * (scale / softcap)
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates correctly at +-inf, no libdevice needed
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        else:
            s = s * qk_scale
        if MASKED:
            visible = k_ok[None, :] & row_ok[:, None]
            if IS_CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)       # (TILE, HEAD_DIM_P)
        elif HEAD_DIM_P != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _write_new_kv(k_row, v_row, slot_ptr, k_dst, v_dst, stride_kb, stride_ks, stride_vb, stride_vs,
                  kw_ptr, pos, inv_freq_ptr, eps, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr,
                  POST_NORM: tl.constexpr, GEMMA: tl.constexpr):
    """One token's KV head: k prepared (norm, RoPE) and v as projected, written at the token's slot (none
    for a negative slot), visible to the whole program before it reads the cache."""
    slot = tl.load(slot_ptr).to(tl.int64)
    if slot >= 0:
        ty = k_dst.dtype.element_ty
        k = _prep_heads(k_row, 0, 1, kw_ptr, pos, inv_freq_ptr, eps, 0.0, 1.0, k_row.dtype.element_ty, 2, HEAD_DIM,
                        HEAD_DIM_P, ROT_DIM, INTERLEAVED, QK_NORM, POST_NORM, GEMMA, False)   # (2, HEAD_DIM_P)
        rows = tl.arange(0, 2)[:, None]
        d = tl.arange(0, HEAD_DIM_P)[None, :]
        ok = (rows < 1) & (d < HEAD_DIM)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        tl.store(k_dst + blk * stride_kb + off * stride_ks + rows * 0 + d, k.to(ty), mask=ok)
        v = tl.load(v_row + rows * 0 + d, mask=ok, other=0.0)
        tl.store(v_dst + blk * stride_vb + off * stride_vs + rows * 0 + d, v.to(v_dst.dtype.element_ty), mask=ok)
    tl.debug_barrier()


def _paged_attention(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, sinks_ptr,
    num_reqs, num_seg, scale, softcap, window,
    stride_ot, stride_oh,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    # PREP (decode batches): q, k, v as projected; this kernel prepares q and k and writes the new k and v
    k_new_ptr, v_new_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, slot_ptr, eps, attn_scale, floor_scale,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr, SEGS: tl.constexpr, PRECISION: tl.constexpr, DECODE: tl.constexpr,
    PREP: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr,
    POST_NORM: tl.constexpr, GEMMA: tl.constexpr, TEMPERATURE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if not (DECODE and SPLIT):
        pdl_wait(PDL)
    # a captured graph's split is a compile-time count (compiled at capture); eager steps' one kernel serves all
    n_seg = SEGS if SEGS > 0 else num_seg
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)

    if DECODE:  # noqa: SIM108  (constexpr branch)        # <= 1 query token per request: q-block = request
        req = pid
    else:
        req = find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
    q0 = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q0
    if DECODE:  # noqa: SIM108  (constexpr branch)
        q_blk = 0
    else:
        q_blk = pid - (q0 // BLOCK_Q + req)
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len                                   # relative position of the request's first query

    offs_m = tl.arange(0, BLOCK_M)
    tok_in_req = q_blk * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok_in_req < q_len)
    q_pos = ctx + tok_in_req
    tok = (q0 + tok_in_req).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM

    # keys some row of this q-block sees: [key_lo, key_hi); keys every row sees: tiles [t_a, t_b)
    first_q = ctx + q_blk * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q, seq_len) - 1
    if IS_CAUSAL:
        key_hi = last_q + 1
        t_b = (first_q + 1) // TILE
    else:
        key_hi = seq_len
        t_b = seq_len // TILE
    if USE_WINDOW:
        key_lo = tl.maximum(first_q - window + 1, 0)
        t_a = (tl.maximum(last_q - window + 1, 0) + TILE - 1) // TILE
    else:
        key_lo = 0
        t_a = 0
    t_lo = key_lo // TILE
    t_hi = (key_hi + TILE - 1) // TILE
    if SPLIT:
        per_seg = (t_hi - t_lo + n_seg - 1) // n_seg
        t_lo = t_lo + seg * per_seg
        t_hi = tl.minimum(t_hi, t_lo + per_seg)
    t_a = tl.minimum(tl.maximum(t_a, t_lo), t_hi)
    t_b = tl.minimum(tl.maximum(t_b, t_a), t_hi)
    if DECODE and SPLIT:
        # The metadata above (query_start_loc, seq_lens) comes from the host, never from the kernel before this
        # one, so a split decode batch (short programs: the fixed chain counts) reads it and sizes its key range
        # while that kernel finishes; q, k and the cache only after the wait. (Unsplit decode batches wait first:
        # reading early made the Llama-4-like batch-32 step ~1% slower on an H100.)
        pdl_wait(PDL)
    if q_blk * BLOCK_Q >= q_len:
        return
    if SPLIT:  # noqa: SIM102  (constexpr branch)
        if t_lo >= t_hi:
            # An empty segment: the grid splits every row as if it were as long as the longest one the launch
            # allows (a captured graph: its table width), so short rows leave most segments without keys. No
            # q, no keys; the (max, sum) pair that gives it no weight, and no accumulator, which the reduction
            # does not read for such a segment.
            row = (tok * (GROUP * tl.num_programs(1)) + head) * n_seg + seg
            tl.store(part_ml_ptr + row * 2, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(part_ml_ptr + row * 2 + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return

    if PREP:        # DECODE: rows 0..GROUP-1 are the token's heads kvh * GROUP + row, the others masked
        pos = tl.load(pos_ptr + q0).to(tl.float32)
        q = _prep_heads(q_ptr + q0.to(tl.int64) * stride_qt + (kvh * GROUP) * stride_qh, stride_qh, GROUP, qw_ptr,
                        pos, inv_freq_ptr, eps, attn_scale, floor_scale, q_ptr.dtype.element_ty, BLOCK_M, HEAD_DIM,
                        HEAD_DIM_P, ROT_DIM, INTERLEAVED, QK_NORM, POST_NORM, GEMMA, TEMPERATURE)
    else:
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    if PREP:
        last_t = (seq_len - 1) // TILE
        if (last_t >= t_lo) & (last_t < t_hi):      # the one segment that reads the new key writes it first
            _write_new_kv(k_new_ptr + q0.to(tl.int64) * stride_nkt + kvh * stride_nkh,
                          v_new_ptr + q0.to(tl.int64) * stride_nvt + kvh * stride_nvh, slot_ptr + q0,
                          k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, stride_kb, stride_ks, stride_vb, stride_vs,
                          kw_ptr, pos, inv_freq_ptr, eps, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, ROT_DIM, INTERLEAVED,
                          QK_NORM, POST_NORM, GEMMA)

    if HAS_SINKS and not SPLIT:
        # the sink's logit joins the max and the sum once per row (it has no value): the running (max, sum)
        # starts at (sink, 1), so its load is issued before the key loop rather than on the epilogue's path
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if DECODE:              # one masked loop: the loads of every tile stream in one pipeline
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, t_lo, t_hi, key_lo, key_hi, q_pos,
                                      row_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                      HEAD_DIM, HEAD_DIM_P, TILE, BLOCK_SIZE, IS_CAUSAL, USE_WINDOW, USE_SOFTCAP,
                                      PRECISION, True)
    else:
        # window front (masked), fully visible middle (no masks), causal diagonal (masked)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, t_lo, t_a, key_lo, key_hi, q_pos,
                                      row_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                      HEAD_DIM, HEAD_DIM_P, TILE, BLOCK_SIZE, IS_CAUSAL, USE_WINDOW, USE_SOFTCAP,
                                      PRECISION, True)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, t_a, t_b, key_lo, key_hi, q_pos,
                                      row_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                      HEAD_DIM, HEAD_DIM_P, TILE, BLOCK_SIZE, IS_CAUSAL, USE_WINDOW, USE_SOFTCAP,
                                      PRECISION, False)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, bt_row, t_b, t_hi, key_lo, key_hi, q_pos,
                                      row_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                      HEAD_DIM, HEAD_DIM_P, TILE, BLOCK_SIZE, IS_CAUSAL, USE_WINDOW, USE_SOFTCAP,
                                      PRECISION, True)

    if not SPLIT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                   # no visible key -> 0
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials laid out (token, head, segment, ...) contiguous; ml holds (max, sum) pairs
        row = (tok * (GROUP * tl.num_programs(1)) + head) * n_seg + seg
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


def _reduce_segments(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, num_heads, num_seg, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SEGS: tl.constexpr, SEG_BLOCK: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Combine the (max, sum, accumulator) partials of the segments. ``SEGS`` > 0 (a captured graph): that many,
    in one shot (at d = 512 up to 32 of them: 64 spilled 5.1 KiB per program, 128 9.3 KiB; looped, none).
    Otherwise (eager steps: ``SEGS`` = 0) ``num_seg`` of them, ``SEG_BLOCK`` at a time with an online rescale, so
    one compiled kernel serves every split. ``HAS_SINKS``: head h's sink logit joins the max and the sum here,
    once (the segments never see it), as a segment with a sum of one and no accumulator."""
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_P)
    if SEGS > 0 and (HEAD_DIM_P <= 256 or SEGS <= 32):
        row = (tok * num_heads + h) * SEGS + tl.arange(0, SEGS)
        m = tl.load(part_ml_ptr + row * 2)
        lsum = tl.load(part_ml_ptr + row * 2 + 1)
        m_max = tl.max(m, 0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)                             # empty segment: m = -inf -> weight 0
        denom = tl.sum(lsum * w, 0)
        if HAS_SINKS:
            denom += tl.exp2(sink - m_safe)
        # a segment without keys wrote no accumulator: not read (and no bytes moved for it)
        has_keys = (m > float("-inf"))[:, None] & (offs_d < HEAD_DIM_P)[None, :]
        acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], mask=has_keys, other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    else:
        n_seg = SEGS if SEGS > 0 else num_seg
        base = (tok * num_heads + h) * n_seg
        offs_s = tl.arange(0, SEG_BLOCK)
        m_run = tl.max(tl.full([SEG_BLOCK], float("-inf"), tl.float32), 0)
        denom = tl.sum(tl.zeros([SEG_BLOCK], tl.float32), 0)
        if HAS_SINKS:       # the running (max, sum) starts at the sink's: (sink, 1)
            m_run = tl.maximum(m_run, tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634)
            denom += 1.0
        acc = tl.zeros([HEAD_DIM_P], tl.float32)
        for s0 in range(0, n_seg, SEG_BLOCK):
            ok = s0 + offs_s < n_seg
            row = base + s0 + offs_s
            m = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"))
            lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_safe)                 # the trips before, rescaled (first trip: 0 x 0)
            w = tl.exp2(m - m_safe)
            has_keys = (m > float("-inf"))[:, None] & (offs_d < HEAD_DIM_P)[None, :]
            part = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], mask=has_keys, other=0.0)
            acc = acc * alpha + tl.sum(part * w[:, None], 0)
            denom = denom * alpha + tl.sum(lsum * w, 0)
            m_run = m_new
        o = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Graph and eager forms (``jit_forms.py``): a captured graph also compiles its split count in (``SEGS``); eager
# steps pass it at run time, and ``_attend`` gives their block tables a stride that is a multiple of 16 (so that
# specialization, which vectorizes the table loads, stays one).
_paged_attention_kernel = two_forms(_paged_attention, per_step=["num_reqs", "num_seg"],
                                    per_step_pointers=["qsl_ptr", "seq_lens_ptr", "pos_ptr", "slot_ptr"])
_reduce_segments_kernel = two_forms(_reduce_segments, per_step=["num_seg"])


def reduce_seg_block(head_dim_p: int) -> int:
    """Segments the reduction reads per loop trip: a (SEG_BLOCK x head_dim) fp32 tile of at most 4096 elements,
    so the 1-2 warps of ``reduce_warps`` hold it in registers (the common 16-32-segment splits take one trip)."""
    return max(1, min(32, 4096 // head_dim_p))


def reduce_warps(head_dim_p: int) -> int:
    """Warps for ``_reduce_segments_kernel``, whose programs are a short dependent chain (load the partials, max,
    exp, weighted sum, store): fewer, busier warps finish first. Measured on an H100 (8-32 segments): 2 warps
    best at head dim 256 (Gemma-3-like, 16 segments, batch 32: 2.9 vs 3.6 µs with 4), 1 warp at 64 and 128
    (Llama-4-like 32 heads, batch 32: 3.1 vs 4.8 µs)."""
    return 2 if head_dim_p >= 256 else 1


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hh = tl.arange(0, HEADS_P)
    dd = tl.arange(0, HEAD_DIM_P)
    mask = (hh[:, None] < num_kv_heads) & (dd[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + hh[:, None] * stride_kh + dd[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + hh[:, None] * stride_vh + dd[None, :], mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + hh[:, None] * stride_kch + dd[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + hh[:, None] * stride_vch + dd[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- host side

def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_segments(*, programs: int, sms: int, max_seq_len: int, tile: int) -> int:
    """The split-KV factor of a launch of ``programs`` (q-block, kv-head) programs: with fewer than the SMs,
    each one's keys split until there are >= 2 programs per SM, into no more segments than the next power of two of
    half the key tiles of the longest row (``max_seq_len`` bounds every seq_len; a captured graph's is the widest row
    its buffers hold, so replays stay correct). Half rounded down: a sliding-128 decode row (at most 160 keys: 3
    tiles) is not split, since its reduction launch would cost more than the split saves."""
    if programs >= sms:
        return 1
    tiles = -(-max_seq_len // tile)
    return min(_MAX_SEGMENTS, _next_pow2(-(-2 * sms // programs)), _next_pow2(max(1, tiles // 2)))


def launch_config(*, head_dim: int, group: int, max_query_len: int, elem_bytes: int = 2) -> dict[str, int]:
    """Tile shapes, the best of sweeps on an H100 (tiles, warps, stages, segments, each checked against the
    reference): decode-only batches get the smallest row tile that holds a GQA group (>= 16 rows for the tensor cores)
    and 64-key tiles, 16 at d >= 256 (one block: more split-KV segments of shorter dependent chains, 11.8 ->
    7.4 µs at B = 1 over 544 keys) in a 4-stage pipeline (their one loop streams; 14.3 vs 15.6 µs at B = 32,
    equal at B = 1); ``paged_attention_triton`` widens them to 128 when d <= 128 and no split
    is needed); batches with prefills get 64 rows x 64 keys with 4 warps at d = 128 (8 warps ran 1.9x
    slower); at d <= 64, 128 x 128 (19% faster at S = 8192, 6% at 2048); at d = 256, 128 rows x 64 keys with
    8 warps (4.4x faster than 32 x 32 at S = 8192), but 64 rows when no query is longer than
    ``SMALL_STEP_TOKENS`` (a captured mixed step's bucket, its few decodes and a prompt chunk: a decode's one token
    fills a q-block's first GQA-group rows, 4 of 128 at Gemma-3's group, and 128-row blocks spill 1.8-2.9 KiB of
    registers a thread, 64-row ones 1.1-1.5: ``benchmarks/sm90_registers.py``; timed in a Gemma-3-like model's
    mixed graph with ``graph_min_segments``: ``gpu_mixed_step.py``, ``docs/performance.md``); each with the same
    error against fp32 SDPA as the shape it replaced. ``elem_bytes`` 4 (fp32 caches) at d = 256 with prefills:
    64 rows x 32 keys, as 128 x 64
    needs 288 KiB of shared memory (an H100 / H200 SM has 227 KiB).

    d = 512 (Gemma-4's global layers) is sized by what sm_90a code compiled from it holds, not yet by timings:
    the (rows x 512) fp32 accumulator is the register budget (rows x 2 KiB over the block's threads), so rows
    stay at 16-32 and keys at 16. Decode: the d >= 256 shape (16 x 16, 4 warps: 196-215 registers, no spill),
    8 warps once a group needs 32+ rows (4 warps spill), 2 stages with fp32 caches (within
    ``shared_memory_bound``). Prefill: 32 rows x 16 keys, 8 warps (at most 12 bytes of spill; 64 rows spill
    0.5-1.8 KiB, 16 x 32 does not but reloads every key tile for half as many rows); fp32 caches 16 x 16 with
    8 warps (4 warps spill in the split form)."""
    hd_p = max(16, _next_pow2(head_dim))
    g_p = _next_pow2(group)
    stages = 2
    if max_query_len <= 1:
        block_m = max(16, g_p)
        tile = 16 if hd_p >= 256 else 64
        warps = 8 if hd_p >= 512 and block_m > 16 else 4
        if hd_p >= 256 and not (hd_p >= 512 and elem_bytes > 2):
            stages = 4
    elif hd_p <= 64:
        block_m, tile, warps = max(128, g_p), 128, 4
    elif hd_p >= 512:
        block_m, tile, warps = max(32 if elem_bytes <= 2 else 16, g_p), 16, 8
    elif hd_p >= 256 and elem_bytes > 2:
        block_m, tile, warps = max(64, g_p), 32, 8
    else:
        block_m = max(64, g_p) if hd_p <= 128 or max_query_len <= SMALL_STEP_TOKENS else max(128, g_p)
        tile = 64
        warps = 4 if hd_p <= 128 else 8
    return {"BLOCK_M": block_m, "BLOCK_Q": max(1, block_m // group), "TILE": tile, "num_warps": warps,
            "num_stages": stages}


# Steps whose longest query is at most this many tokens (a captured mixed step's is its bucket: a few decodes and a
# prompt chunk) take the d = 256 prefill shape with 64 rows (``launch_config``).
SMALL_STEP_TOKENS = 512


def graph_min_segments(*, head_dim: int, num_kv_heads: int, max_query_len: int, elem_bytes: int) -> int:
    """The least split-KV factor of a step captured in a graph. A captured mixed step's request rows are its
    buffers' capacity (``max_num_seqs`` + 1), not its work, so ``split_segments`` sees enough programs never to
    split, while the real ones (one per decode, a few per prompt chunk, per KV head) may fill a third of the SMs.
    Where that was measured, d = 256 with one KV head and bf16 caches, queries of at most ``SMALL_STEP_TOKENS``: 2
    (``docs/design.md``); elsewhere 1 (more KV heads make more programs; not measured)."""
    small = 1 < max_query_len <= SMALL_STEP_TOKENS and elem_bytes <= 2 and num_kv_heads == 1
    return 2 if small and max(16, _next_pow2(head_dim)) == 256 else 1


SHARED_MEMORY_PER_BLOCK = 227 * 1024    # the opt-in maximum of an H100 / H200 SM


def shared_memory_bound(cfg: dict[str, int], *, head_dim: int, elem_bytes: int) -> int:
    """An upper bound on the shared memory of ``_paged_attention_kernel`` under ``cfg``: ``num_stages`` buffers of
    a K and a V tile, the q tile and the fp32 score tile. What Triton 3.9 allocates for sm_90a is at most this
    (fp32 caches at d = 256, 128 x 64: 288.5 KiB allocated, bound 416 KiB; d = 512 decode, fp32: 97 vs 161 KiB;
    d = 512 prefill, bf16: 49 vs 98 KiB), so a config within ``SHARED_MEMORY_PER_BLOCK`` launches."""
    hd_p = max(16, _next_pow2(head_dim))
    kv_tiles = 2 * cfg["TILE"] * hd_p * elem_bytes
    return cfg["num_stages"] * kv_tiles + cfg["BLOCK_M"] * hd_p * elem_bytes + cfg["BLOCK_M"] * cfg["TILE"] * 4


MAX_HEAD_DIM = 512      # Gemma-4's global layers; larger heads would need the accumulator split over programs


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cam: CommonAttentionMetadata,
           sliding_window: int | None, *, sinks: torch.Tensor | None = None, op: str = "paged_attention") -> None:
    num_tokens, num_heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise UnsupportedConfig("triton", op, f"head_dim {head_dim} > {MAX_HEAD_DIM} (the fp32 accumulator "
                                "tile, rows x head_dim, would not fit the registers of one program)")
    if num_tokens != cam.num_actual_tokens:
        raise ValueError(f"q: has {num_tokens} tokens, metadata has {cam.num_actual_tokens}")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache: shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} vs q {tuple(q.shape)}"
        )
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"q: num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if k_cache.shape[1] != cam.block_size:
        raise ValueError(f"k_cache: block size {k_cache.shape[1]} != metadata block_size {cam.block_size}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be positive, got {sliding_window}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 1), got {t.stride()}")
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or sinks.stride(0) != 1 or sinks.device != q.device):
        raise ValueError(f"sinks: shape {tuple(sinks.shape)} / strides {sinks.stride()} on {sinks.device}; expected "
                         f"({num_heads},) contiguous on {q.device} (one logit per query head)")


def paged_attention_triton(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), any strides, last one 1
    v_cache: torch.Tensor,
    cam: CommonAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_ref``. ``out``: optional (num_tokens, num_heads, head_dim)
    destination; ``num_segments``: split-KV factor (default: chosen from the grid size and
    ``cam.max_seq_len``, which must bound every seq_len)."""
    _check(q, k_cache, v_cache, cam, sliding_window, sinks=sinks)
    return _attend(q, k_cache, v_cache, cam, scale=scale, sliding_window=sliding_window, softcap=softcap,
                   sinks=sinks, out=out, num_segments=num_segments, fresh=None)


def rope_attention_triton(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), as projected
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
    cam: CommonAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Same contract as ``rope_attention_ref``. A decode batch (``cam.max_query_len <= 1``) is one launch:
    each attention program prepares its own q rows, and the program whose key range holds a request's new
    key prepares that key and writes it with v before reading the cache (so K/V are written for the tokens
    of the batch's requests, every token a step schedules; a token outside every request, which the engine
    never builds, is not written). Other batches run ``qk_rope_write_kv_triton`` then ``paged_attention_triton``
    (their new keys are read by many programs)."""
    if cam.max_query_len > 1:
        q = qk_rope_write_kv_triton(q, k, v, positions, prep=prep, inv_freq=inv_freq, q_norm_weight=q_norm_weight,
                                    k_norm_weight=k_norm_weight, k_cache=k_cache, v_cache=v_cache,
                                    slot_mapping=slot_mapping)
        return paged_attention_triton(q, k_cache, v_cache, cam, scale=scale, sliding_window=sliding_window,
                                      softcap=softcap, sinks=sinks, num_segments=num_segments)
    _check(q, k_cache, v_cache, cam, sliding_window, sinks=sinks, op="rope_attention")
    slots = slot_mapping if slot_mapping.device == q.device else slot_mapping.to(q.device)
    fresh = qk_prep_arguments(q, k, v, positions, prep=prep, inv_freq=inv_freq, q_norm_weight=q_norm_weight,
                              k_norm_weight=k_norm_weight, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    fresh.update(k_new_ptr=k, v_new_ptr=v, stride_nkt=k.stride(0), stride_nkh=k.stride(1), stride_nvt=v.stride(0),
                 stride_nvh=v.stride(1))
    return _attend(q, k_cache, v_cache, cam, scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                   out=None, num_segments=num_segments, fresh=fresh)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cam: CommonAttentionMetadata, *,
            scale: float, sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None,
            out: torch.Tensor | None, num_segments: int | None, fresh: dict | None) -> torch.Tensor:
    """The launch behind both ops; ``fresh``: ``qk_prep_arguments`` plus the new k / v rows (decode only)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out: shape {tuple(out.shape)} / strides {out.stride()} do not fit q {tuple(q.shape)}")
    if num_tokens == 0 or cam.num_reqs == 0:
        return out
    cfg = launch_config(head_dim=head_dim, group=group, max_query_len=cam.max_query_len,
                        elem_bytes=k_cache.element_size())
    hd_p = max(16, _next_pow2(head_dim))
    decode = cam.max_query_len <= 1        # one q-block per request: no search for a program's request
    n_qblocks = cam.num_reqs if decode else num_tokens // cfg["BLOCK_Q"] + cam.num_reqs
    if num_segments is None:
        num_segments = 1
        if q.is_cuda:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            num_segments = split_segments(programs=n_qblocks * num_kv_heads, sms=sms, max_seq_len=cam.max_seq_len,
                                          tile=cfg["TILE"])
            if capturing(q):
                num_segments = max(num_segments, graph_min_segments(
                    head_dim=head_dim, num_kv_heads=num_kv_heads, max_query_len=cam.max_query_len,
                    elem_bytes=k_cache.element_size()))
    num_segments = _next_pow2(max(1, int(num_segments)))
    if cam.max_query_len <= 1 and num_segments == 1 and hd_p <= 128:
        cfg["TILE"] = 128   # long decode rows, no split: wider tiles, fewer loop trips (~5% at B=32, 8k)
    # A captured graph replays one split forever: its count is compiled in (as fast as a fixed-count kernel can
    # be); eager steps pass it at run time, so their varying splits share one compile (no JIT while serving).
    segs = num_segments if num_segments > 1 and capturing(q) else 0
    if num_segments > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_segments, hd_p, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_segments, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out   # unused
    bt = cam.block_table_tensor
    if bt.device != q.device:
        bt = bt.to(q.device)
    if bt.is_cuda and bt.dim() == 2 and bt.stride(0) % 16 and not capturing(bt):
        # a per-step table width: null columns up to a multiple of 16, one specialization for every step
        # (a captured graph's tables have a fixed width: compiled at capture)
        bt = torch.nn.functional.pad(bt, (0, -bt.shape[1] % 16))
    qsl = cam.query_start_loc if cam.query_start_loc.device == q.device else cam.query_start_loc.to(q.device)
    seq = cam.seq_lens if cam.seq_lens.device == q.device else cam.seq_lens.to(q.device)
    if fresh is None:
        fresh = dict(k_new_ptr=q, v_new_ptr=q, pos_ptr=qsl, inv_freq_ptr=q, qw_ptr=q, kw_ptr=q, slot_ptr=qsl, eps=0.0,
                     attn_scale=0.0, floor_scale=1.0, stride_nkt=0, stride_nkh=0, stride_nvt=0, stride_nvh=0,
                     ROT_DIM=0, INTERLEAVED=False, QK_NORM=False, POST_NORM=False, GEMMA=False, TEMPERATURE=False)
        prep = False
    else:
        prep = True
    _paged_attention_kernel.pick(q)[(n_qblocks, num_kv_heads, num_segments)](
        out_ptr=out, part_acc_ptr=part_acc, part_ml_ptr=part_ml,
        q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, bt_ptr=bt, qsl_ptr=qsl, seq_lens_ptr=seq,
        sinks_ptr=sinks if sinks is not None else q,
        num_reqs=cam.num_reqs, num_seg=num_segments, scale=float(scale), softcap=float(softcap or 1.0),
        window=int(sliding_window or 0),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_bt=bt.stride(0) if bt.dim() == 2 and bt.shape[1] > 0 else 0,
        HEAD_DIM=head_dim, HEAD_DIM_P=hd_p, GROUP=group,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"], TILE=cfg["TILE"], BLOCK_SIZE=cam.block_size,
        IS_CAUSAL=bool(cam.causal), USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        SPLIT=num_segments > 1, SEGS=segs, PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        DECODE=decode,
        PREP=prep, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **fresh, **pdl_kwargs(out.device),
    )
    if num_segments > 1:
        _reduce_segments_kernel.pick(q)[(num_tokens, num_heads)](
            out, part_acc, part_ml, sinks if sinks is not None else out, num_heads, num_segments, out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_P=hd_p, SEGS=segs, SEG_BLOCK=reduce_seg_block(hd_p),
            HAS_SINKS=sinks is not None, num_warps=reduce_warps(hd_p),
            **pdl_kwargs(out.device),
        )
    return out


def write_kv_triton(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) slot = block_id * block_size + offset; < 0 = skip
) -> None:
    """Same contract as ``write_kv_ref`` (plus: negative slots are skipped, for padded batches)."""
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"k/v/slot_mapping: shapes {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slot_mapping.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    n, heads, d = k.shape
    if n == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k/v/caches: the head_dim axis must be contiguous (stride 1)")
    slots = slot_mapping if slot_mapping.device == k.device else slot_mapping.to(k.device)
    _write_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slots, heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, HEADS_P=_next_pow2(heads), HEAD_DIM_P=_next_pow2(d), BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if heads * d <= 1024 else 4, **pdl_kwargs(k.device),
    )


def dense_bytes(head_dim: int, num_kv_heads: int, seq_lens: list[int], elem: int = 2) -> int:
    """K+V bytes a decode step must read (each key once): the attention roofline's numerator."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem


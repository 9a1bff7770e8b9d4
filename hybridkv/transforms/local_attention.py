"""Chunked-local attention (Llama-4 "local" layers) as virtual batches for any causal paged kernel.

A query at absolute position p sees keys k <= p with k // C == p // C. Cutting each request's queries at
chunk boundaries into *virtual requests* whose block-table row starts at the chunk's first block turns that
into plain causal attention: the kernel needs no chunk mask at all.

Worked example (C = 4, block_size = 2; q = query token, k = cached key, | = chunk boundary)::

    request 0: q_len 4, seq_len 6     k k q q | q q
    request 1: q_len 10, seq_len 17   k k k k | k k k q | q q q q | q q q q | q
    request 2: q_len 5, seq_len 9     k k k k | q q q q | q

    virtual:   0    1    2    3    4    5    6    7
    q_len:     2    2    1    4    4    1    4    1
    seq_len:   4    2    4    4    4    1    4    1
    key_start: 0    4    4    8    12   16   4    8      (row starts at block key_start // 2)

Two forms: ``make_local_attention_virtual_batches`` (host numpy, exact shapes; the hot path) and
``make_local_attention_virtual_batches_device`` (torch, static shapes padded to ``max_virtual_reqs``, no
device-to-host sync, so it can be recorded in a CUDA graph; vLLM syncs here and gives up graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.metadata import CommonAttentionMetadata, debug_enabled
from hybridkv.transforms.block_rows import floordiv, gather_block_rows

__all__ = [
    "make_local_attention_virtual_batches",
    "make_local_attention_virtual_batches_device",
    "max_local_virtual_batches",
]


def _check_chunk(cam: CommonAttentionMetadata, attn_chunk_size: int) -> int:
    if not isinstance(attn_chunk_size, (int, np.integer)) or isinstance(attn_chunk_size, bool):
        raise ValueError(f"attn_chunk_size: must be an int, got {attn_chunk_size!r}")
    if attn_chunk_size <= 0 or attn_chunk_size % cam.block_size:
        raise ValueError(
            f"attn_chunk_size: must be a positive multiple of block_size={cam.block_size}, "
            f"got {attn_chunk_size}"
        )
    return int(attn_chunk_size)


def max_local_virtual_batches(attn_chunk_size: int, max_num_reqs: int, max_num_tokens: int) -> int:
    """Upper bound on virtual requests, for sizing ``max_virtual_reqs`` once (e.g. per CUDA graph).

    A request with q > 0 queries spans at most ``(q - 1) // C + 2`` chunks; summed over requests that is at
    most ``2 * num_reqs + num_tokens // C``, and every virtual request holds at least one token.
    """
    return max(0, min(max_num_tokens, 2 * max_num_reqs + max_num_tokens // attn_chunk_size))


def _virtual_host(
    cam: CommonAttentionMetadata, chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """(req, q_len, seq_len, key_start, first column, blocks) of every virtual request (int32/intp), and
    whether there is exactly one per input request (so the query offsets are unchanged)."""
    qsl, s, ks, bs = cam.query_start_loc_cpu, cam.seq_lens_cpu, cam.key_start_cpu, cam.block_size
    # (numpy call overhead dominates at these sizes, so the decode path below is kept to few calls)
    q = qsl[1:] - qsl[:-1]
    a1 = ks + s  # absolute position one past each request's last query
    a0 = a1 - q  # absolute position of its first query
    c0 = floordiv(a0, chunk)
    lo0 = c0 * chunk  # start of the chunk of the first query
    if q.all() and (a1 - lo0 <= chunk).all():  # each request inside one chunk (e.g. decodes): 1:1
        req = np.arange(cam.num_reqs)
        lo, qv, kv = lo0, q, a1 - lo0
        col0 = floordiv(lo0 - ks, bs)
        missing = col0.size > 0 and col0.min() < 0
    else:
        live = q > 0
        cnt = np.where(live, floordiv(a1 - 1, chunk) - c0 + 1, 0)
        missing = (live & (ks > lo0)).any()
        req = np.repeat(np.arange(cam.num_reqs), cnt)
        starts = np.cumsum(cnt) - cnt
        lo = (c0[req] + (np.arange(len(req), dtype=np.int32) - starts[req])) * chunk
        hi = np.minimum(a1[req], lo + chunk)
        qv = hi - np.maximum(a0[req], lo)
        kv = hi - lo
        col0 = floordiv(lo - ks[req], bs)
    if missing:
        raise ValueError(
            "key_start_cpu: the block table starts after the first query's chunk "
            "(trimmed with a window narrower than the chunk?); its keys are gone"
        )
    nblk = floordiv(kv + (bs - 1), bs)
    return req, qv, kv, lo, col0, nblk, qv is q


def make_local_attention_virtual_batches(
    cam: CommonAttentionMetadata, attn_chunk_size: int
) -> CommonAttentionMetadata:
    """Split every request's queries at chunk boundaries into virtual requests (see the module diagram).

    Virtual requests keep token order, so ``slot_mapping`` and the query/output tensors are unchanged.
    Requests with no queries produce no virtual request. Returns ``cam`` itself when every request already
    lies in the chunk its block table starts at (e.g. all sequences shorter than C). Needs each first
    query's chunk to still be in the block table (``key_start <= chunk start``), otherwise ValueError.
    """
    chunk = _check_chunk(cam, attn_chunk_size)
    if cam.num_reqs and cam.max_query_len == 1 and cam.num_actual_tokens == cam.num_reqs:
        return _one_query_each(cam, chunk)
    req, qv, kv, lo, col0, nblk, one_each = _virtual_host(cam, chunk)
    if one_each:  # same requests, same query offsets (the decode hot path): reuse them, host and device
        if not col0.any():
            return cam
        qsl, qsl_dev = cam.query_start_loc_cpu, cam.query_start_loc
    else:
        qsl, qsl_dev = np.zeros(len(req) + 1, np.int32), None
        np.cumsum(qv, out=qsl[1:])
    width = int(nblk.max()) if len(nblk) else 0
    bt = gather_block_rows(cam.block_table_cpu, req, col0, nblk, width)
    return CommonAttentionMetadata.from_host(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl_dev,
        query_lens_cpu=qv.astype(np.int32, copy=False),
        seq_lens_cpu=kv.astype(np.int32, copy=False),
        key_start_cpu=lo.astype(np.int32, copy=False),
        block_table_cpu=bt,
        slot_mapping=cam.slot_mapping,
        block_size=cam.block_size,
        device=cam.device,
        causal=cam.causal,
    )


def query_chunk_columns(query_pos: np.ndarray, key_start: np.ndarray | int, chunk: int, block_size: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """For one query per row at absolute ``query_pos`` (n,) in a table starting at ``key_start``: (keys of its
    chunk before it (n,), the table column where its chunk starts (n,))."""
    into = query_pos % chunk
    col0 = floordiv(query_pos - into - key_start, block_size)
    if np.minimum.reduce(col0) < 0:
        raise ValueError(
            "key_start_cpu: the block table starts after the first query's chunk "
            "(trimmed with a window narrower than the chunk?); its keys are gone"
        )
    return into, col0


def _one_query_each(cam: CommonAttentionMetadata, chunk: int) -> CommonAttentionMetadata:
    """``make_local_attention_virtual_batches`` when every request has exactly one query (decodes): each is
    its own virtual request, reading its chunk's keys up to the query. Few numpy calls: at batch 256 their
    overhead, not the data, is the cost."""
    bs, ks = cam.block_size, cam.key_start_cpu
    aligned = not (np.bitwise_or.reduce(ks) & (chunk - 1)) if chunk & (chunk - 1) == 0 else not (ks % chunk).any()
    if aligned and np.maximum.reduce(cam.seq_lens_cpu) <= chunk:  # each row starts at its query's chunk
        return cam
    into, col0 = query_chunk_columns(ks + cam.num_computed_tokens_cpu, ks, chunk, bs)
    lo = ks + cam.num_computed_tokens_cpu - into  # chunk start
    if not col0.any():
        return cam
    nblk = floordiv(into, bs)
    nblk += 1
    bt = gather_block_rows(cam.block_table_cpu, np.arange(cam.num_reqs), col0, nblk, int(np.maximum.reduce(nblk)))
    return cam.with_keys(seq_lens_cpu=into + 1, key_start_cpu=lo, block_table_cpu=bt, num_computed_tokens_cpu=into)


def make_local_attention_virtual_batches_device(
    cam: CommonAttentionMetadata, attn_chunk_size: int, max_virtual_reqs: int
) -> CommonAttentionMetadata:
    """Virtual batches computed from the *device* tensors with static shapes and no device-to-host sync.

    Output has exactly ``max_virtual_reqs`` requests (the real ones first, then padding with query_len 0,
    seq_len 0, key_start 0 and null rows) and ``min(C // block_size, max_blocks)`` block columns, so it can
    be recorded in a CUDA graph and replayed on new inputs. The host twins and scalars come from the host
    algorithm on the host twins of the input (no sync), padded the same way: they describe the batch the
    graph was captured with, while a replay only recomputes the device fields. A batch with more virtual
    requests than ``max_virtual_reqs`` raises ValueError (size it with ``max_local_virtual_batches``).
    """
    chunk = _check_chunk(cam, attn_chunk_size)
    if max_virtual_reqs < 0:
        raise ValueError(f"max_virtual_reqs: must be >= 0, got {max_virtual_reqs}")
    bs, n, v_max = cam.block_size, cam.num_reqs, int(max_virtual_reqs)
    width = min(chunk // bs, cam.max_blocks)
    dev = cam.device

    # ---- device: only torch ops with shapes fixed by (num_reqs, max_virtual_reqs, width)
    qsl_d = cam.query_start_loc.long()
    s_d, ks_d = cam.seq_lens.long(), cam.key_start.long()
    q_d = qsl_d[1:] - qsl_d[:-1]
    a0 = ks_d + s_d - q_d
    a1 = ks_d + s_d
    c0 = torch.div(a0, chunk, rounding_mode="floor")
    cnt = torch.where(q_d > 0, torch.div(a1 - 1, chunk, rounding_mode="floor") - c0 + 1, 0)
    vid = torch.arange(v_max, device=dev)
    if n:
        cum = torch.cumsum(cnt, 0)
        req = torch.searchsorted(cum, vid, right=True).clamp_(max=n - 1)
        valid = vid < cum[-1]
        first = c0[req] + vid - (cum[req] - cnt[req])
        lo = first * chunk
        hi = torch.minimum(a1[req], lo + chunk)
        qv = torch.where(valid, hi - torch.maximum(a0[req], lo), 0)
        kv = torch.where(valid, hi - lo, 0)
        lo = torch.where(valid, lo, 0)
        col0 = torch.div(lo - ks_d[req], bs, rounding_mode="floor")
        j = torch.arange(width, device=dev)
        cols = (col0[:, None] + j).clamp_(0, max(cam.max_blocks - 1, 0))
        nblk = torch.div(kv + bs - 1, bs, rounding_mode="floor")
        rows = cam.block_table_tensor[req]  # (max_virtual_reqs, max_blocks)
        bt_d = torch.where(j < nblk[:, None], torch.gather(rows, 1, cols), 0).to(torch.int32)
    else:
        qv = kv = lo = torch.zeros(v_max, dtype=torch.long, device=dev)
        bt_d = torch.zeros((v_max, width), dtype=torch.int32, device=dev)
    qsl_out = torch.zeros(v_max + 1, dtype=torch.int32, device=dev)
    qsl_out[1:] = torch.cumsum(qv, 0)

    # ---- host twins: the same result, padded the same way
    req_h, qv_h, kv_h, lo_h, col0_h, nblk_h, _ = _virtual_host(cam, chunk)
    n_virt = len(req_h)
    if n_virt > v_max:
        raise ValueError(f"max_virtual_reqs: {v_max} is below the {n_virt} virtual requests of this batch")
    pad = v_max - n_virt
    qsl_h = np.zeros(v_max + 1, np.int32)
    np.cumsum(np.pad(qv_h, (0, pad)), out=qsl_h[1:])
    seq_h = np.pad(kv_h, (0, pad)).astype(np.int32)
    bt_h = np.zeros((v_max, width), np.int32)
    bt_h[:n_virt] = gather_block_rows(cam.block_table_cpu, req_h, col0_h, nblk_h, width)
    scalars = CommonAttentionMetadata.derive_scalars(qsl_h, seq_h)
    out = CommonAttentionMetadata(
        **scalars,
        query_start_loc=qsl_out,
        query_start_loc_cpu=qsl_h,
        seq_lens=kv.to(torch.int32),
        seq_lens_cpu=seq_h,
        num_computed_tokens_cpu=seq_h - np.diff(qsl_h),
        key_start=lo.to(torch.int32),
        key_start_cpu=np.pad(lo_h, (0, pad)).astype(np.int32),
        block_table_tensor=bt_d,
        block_table_cpu=bt_h,
        slot_mapping=cam.slot_mapping,
        block_size=bs,
        causal=cam.causal,
    )
    if debug_enabled():
        out.validate()
    return out

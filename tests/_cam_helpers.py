"""Shared helpers for the metadata/transform/attention tests: random batches and a dense oracle.

The oracle works on contiguous per-request K/V at *absolute* positions with an explicit mask, so it knows
nothing about block tables, key_start, trimming or virtual batches; the paged path must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.utils import cdiv

BLOCK_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True)
class Batch:
    """A random step: request lengths, a block table with shuffled ids, and K/V/Q to match."""

    cam: CommonAttentionMetadata
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k_dense: list[torch.Tensor]  # per request (seq_len, num_kv_heads, head_dim), absolute positions
    v_dense: list[torch.Tensor]
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim); unwritten slots are NaN
    v_cache: torch.Tensor
    scale: float


def make_block_table(
    seq_lens: list[int], block_size: int, rng: np.random.Generator, extra_cols: int = 0
) -> tuple[np.ndarray, int]:
    """(num_reqs, width) table with a random permutation of ids 1.. (0 = null) and the pool size."""
    need = [cdiv(s, block_size) for s in seq_lens]
    total = sum(need)
    spare = int(rng.integers(0, 4))
    ids = rng.permutation(np.arange(1, total + spare + 1))
    width = max(need, default=0) + extra_cols
    bt = np.zeros((len(seq_lens), width), np.int64)
    off = 0
    for r, k in enumerate(need):
        bt[r, :k] = ids[off : off + k]
        off += k
    return bt, total + spare + 1


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    seed: int,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    extra_cols: int = 0,
) -> Batch:
    """Build the CAM and fill a NaN-initialised cache: context K/V directly, the step's K/V through
    ``write_kv_ref`` and the CAM's slot mapping (so the slot mapping is exercised too)."""
    from hybridkv.layers.ops.attention_ref import write_kv_ref

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    bt, num_blocks = make_block_table(seq_lens, block_size, rng, extra_cols)
    cam = CommonAttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_table=bt, block_size=block_size
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    k_dense = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    v_dense = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    for r, (ql, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        ctx = s - ql
        pos = np.arange(ctx)
        slots = torch.from_numpy(bt[r, pos // block_size] * block_size + pos % block_size)
        flat_k[slots] = k_dense[r][:ctx]
        flat_v[slots] = v_dense[r][:ctx]
    qsl = cam.query_start_loc_cpu
    new_k = torch.cat(
        [k_dense[r][s - ql :] for r, (ql, s) in enumerate(zip(query_lens, seq_lens, strict=True))]
        or [torch.zeros(0, num_kv_heads, head_dim)]
    )
    new_v = torch.cat(
        [v_dense[r][s - ql :] for r, (ql, s) in enumerate(zip(query_lens, seq_lens, strict=True))]
        or [torch.zeros(0, num_kv_heads, head_dim)]
    )
    assert new_k.shape[0] == int(qsl[-1])
    write_kv_ref(new_k, new_v, k_cache, v_cache, cam.slot_mapping)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen)
    return Batch(
        cam=cam, q=q, k_dense=k_dense, v_dense=v_dense, k_cache=k_cache, v_cache=v_cache, scale=head_dim**-0.5
    )


def dense_attention(
    batch: Batch,
    *,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """(num_tokens, num_heads, head_dim) float32: float64 attention on the contiguous K/V with an explicit
    mask over absolute positions: causal, plus ``p - W < k`` and/or ``k // C == p // C``. ``sinks``
    (num_heads,): gpt-oss's sink logits, written as HF writes them: one more column of logits per head,
    softmaxed with the keys and dropped before the values."""
    cam, q = batch.cam, batch.q.double()
    out = torch.zeros_like(q)
    qsl, seq = cam.query_start_loc_cpu, cam.seq_lens_cpu
    for r in range(cam.num_reqs):
        t0, t1, s = int(qsl[r]), int(qsl[r + 1]), int(seq[r])
        if t0 == t1:
            continue
        group = q.shape[1] // batch.k_dense[r].shape[1]
        k = batch.k_dense[r].double().repeat_interleave(group, 1)
        v = batch.v_dense[r].double().repeat_interleave(group, 1)
        p = torch.arange(s - (t1 - t0), s)[:, None]
        kk = torch.arange(s)[None, :]
        mask = kk <= p
        if window is not None:
            mask &= p - kk < window
        if chunk is not None:
            mask &= kk // chunk == p // chunk
        logits = torch.einsum("nhd,khd->hnk", q[t0:t1], k) * batch.scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.double()[:, None, None].expand(-1, t1 - t0, 1)
            probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(logits, -1)
        out[t0:t1] = torch.einsum("hnk,khd->nhd", probs, v)
    return out.float()


def referenced_blocks(cam: CommonAttentionMetadata) -> set[int]:
    """Block ids some row reads: the columns its seq_len covers."""
    nblk = -(-cam.seq_lens_cpu // cam.block_size)
    return {int(b) for r in range(cam.num_reqs) for b in cam.block_table_cpu[r, : nblk[r]]}


def poison_unreferenced(batch: Batch, *cams: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches where every block that none of ``cams`` references holds NaN."""
    keep = set().union(*(referenced_blocks(c) for c in cams))
    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    dead = torch.tensor([b for b in range(k.shape[0]) if b not in keep], dtype=torch.long)
    k[dead] = float("nan")
    v[dead] = float("nan")
    return k, v


@st.composite
def batch_specs(draw: st.DrawFn, max_reqs: int = 5, max_len: int = 40) -> tuple[list[int], list[int], int]:
    """(query_lens, seq_lens, block_size): a random mix of decodes, prefills and chunked prefills."""
    n = draw(st.integers(1, max_reqs))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    q_lens, s_lens = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "prefill", "chunked"]))
        if kind == "decode":
            s = draw(st.integers(1, max_len))
            q = 1
        elif kind == "prefill":
            s = draw(st.integers(1, max_len))
            q = s
        else:
            s = draw(st.integers(2, max_len))
            q = draw(st.integers(1, s - 1))
        q_lens.append(q)
        s_lens.append(s)
    return q_lens, s_lens, block_size


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not torch.isnan(actual).any(), "NaN in output: a block outside the metadata was read"
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def assert_cam_equal(a: CommonAttentionMetadata, b: CommonAttentionMetadata) -> None:
    """Field-by-field equality (arrays by value, including dtype); iterates the dataclass fields so a new
    field is compared too."""
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), f"{f.name}: {x} != {y}"
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{f.name}: {x} != {y}"
        else:
            assert x == y, f"{f.name}: {x} != {y}"


def run_paged(
    batch: Batch,
    cams: list[CommonAttentionMetadata] | CommonAttentionMetadata,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Reference paged attention over consecutive parts covering the batch's tokens, concatenated."""
    from hybridkv.layers.ops.attention_ref import paged_attention_ref

    parts = cams if isinstance(cams, list) else [cams]
    k_cache = batch.k_cache if k_cache is None else k_cache
    v_cache = batch.v_cache if v_cache is None else v_cache
    outs, t = [], 0
    for part in parts:
        n = part.num_actual_tokens
        outs.append(
            paged_attention_ref(batch.q[t : t + n], k_cache, v_cache, part, scale=batch.scale, **kwargs)
        )
        t += n
    assert t == batch.q.shape[0]
    return torch.cat(outs)

"""The ``flash_attn`` vendor op: our ``paged_attention`` contract on flash-attn 2's varlen kernel over a paged
KV cache (``flash_attn_varlen_func(..., block_table=...)``). API read from flash-attn 2.8.3 (needs >= 2.6 for
``softcap``, >= 2.5 for ``block_table``); verified on an H100 against the reference, op by op and through the
whole engine (docs/performance.md, "Vendor backends"). Why ``backend="auto"`` does not take it: with a block
table FA2 always runs its split-KV kernel, which took 1.03-2.35x our Triton kernel's time on every measured
shape; ``backend="flash_attn"`` still asks for it.

How a ``CommonAttentionMetadata`` maps onto the call:

- q (num_tokens, heads, d) is packed like the CAM: ``cu_seqlens_q = query_start_loc`` (int32),
  ``max_seqlen_q = max_query_len``;
- k/v caches (num_blocks, block_size, kv_heads, d) are FA2's paged layout as they are (it indexes blocks
  by ``stride(0)``, so the pool's strided ``kv[:, 0]`` / ``kv[:, 1]`` views need no copy);
- ``block_table = block_table_tensor`` (int32): row r starts at the block holding ``key_start[r]``;
- with a block table FA2 takes only the key *counts* from ``cu_seqlens_k = [0, cumsum(seq_lens)]``
  (``seqused_k`` is not exposed by upstream's Python API), ``max_seqlen_k = max_seq_len``;
- positions: FA2 aligns the causal and window masks bottom-right, i.e. query i of a request with sq queries
  and sk keys sits at key position ``i + sk - sq``. That is exactly the CAM's convention (a request's queries
  are the last ``query_len`` of its ``seq_len`` keys counted from ``key_start``), so sliding-window-trimmed
  tables and local-attention virtual batches map with nothing special;
- window W (HF: ``p - W < k``) -> ``window_size = (W - 1, 0)`` causal, ``(W - 1, -1)`` non-causal;
  ``softcap`` -> ``softcap`` (0.0 = off); ``scale`` -> ``softmax_scale``; ``cam.causal`` -> ``causal``;
- a query with no visible key gets 0 from FA2, as from the reference.

Where it cannot map (``UnsupportedConfig``; ``auto``, were it to take this op, would fall back to triton):
block size not a multiple of 256 (FA2 paged KV; our default is 16), dtype other than fp16/bf16 or caches in
another dtype, head_dim not a multiple of 8 or above 256 (FA2 would pad by copying the whole cache), a device
below sm80, attention sinks (gpt-oss: FA2's softmax has no extra per-head logit, and adding one after the fact
would need its unexposed log-sum-exp per row).
The KV write stays triton's (``write_kv``): FA2 has no slot-mapping write.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.backends.base import UnsupportedConfig
from hybridkv.metadata import CommonAttentionMetadata

logger = logging.getLogger("hybridkv.backends")

__all__ = ["PAGE_MULTIPLE", "flash_attn_ops", "make_paged_attention", "varlen_arguments"]

BACKEND = "flash_attn"
PAGE_MULTIPLE = 256       # FA2: "Paged KV cache block size must be divisible by 256"
_MAX_HEAD_DIM = 256


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_reason(q: torch.Tensor) -> str | None:
    """Why the device cannot run FA2 (None: it can). Tests without a GPU replace this."""
    if not q.is_cuda:
        return f"tensors are on {q.device.type}, flash-attn runs on CUDA"
    cap = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if cap < (8, 0):
        return f"compute capability {cap[0]}.{cap[1]} (flash-attn 2 needs 8.0 or newer)"
    return None


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, cam: CommonAttentionMetadata, *,
                       softcap: float | None, has_softcap: bool, sinks: torch.Tensor | None = None) -> str | None:
    """The first FA2 constraint this call breaks, or None. Reads shapes and dtypes only (no sync)."""
    if sinks is not None:
        return ("attention sinks (flash-attn 2 has no per-head sink logit in its softmax; the triton and torch "
                "backends have)")
    if cam.block_size % PAGE_MULTIPLE:
        return f"block size {cam.block_size} is not a multiple of {PAGE_MULTIPLE} (flash-attn 2 paged KV)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (flash-attn takes float16 / bfloat16)"
    if k_cache.dtype != q.dtype:
        return f"KV cache dtype {k_cache.dtype} differs from q's {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > _MAX_HEAD_DIM:
        return f"head_dim {d} (flash-attn 2 needs a multiple of 8, at most {_MAX_HEAD_DIM})"
    if softcap is not None and not has_softcap:
        return "softcap needs flash-attn >= 2.6"
    return _device_reason(q)


def varlen_arguments(q: torch.Tensor, cam: CommonAttentionMetadata, *, scale: float,
                     sliding_window: int | None, softcap: float | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional (after q, k, v) and keyword arguments of ``flash_attn_varlen_func`` for this CAM.

    Under CUDA-graph capture the maxima are the static bounds num_tokens / table width * block size (the
    host maxima would be baked into the graph); FA2 only sizes its grid and split heuristics with them."""
    dev = q.device
    qsl = cam.query_start_loc.to(dev)                                        # (num_reqs + 1,) int32
    seq = cam.seq_lens.to(dev)                                               # (num_reqs,) int32
    cu_k = F.pad(torch.cumsum(seq, 0, dtype=torch.int32), (1, 0))            # (num_reqs + 1,) int32
    bt = cam.block_table_tensor.to(dev)                                      # (num_reqs, max_blocks) int32
    if bt.stride(-1) != 1:
        bt = bt.contiguous()
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        max_q, max_k = q.shape[0], bt.shape[1] * cam.block_size
    else:
        max_q, max_k = cam.max_query_len, cam.max_seq_len
    # FA2: query i sees keys [i + sk - sq - left, i + sk - sq + right]; -1 = unbounded
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0 if cam.causal else -1)
    kwargs: dict[str, Any] = dict(dropout_p=0.0, softmax_scale=float(scale), causal=bool(cam.causal),
                                  window_size=window, block_table=bt)
    if softcap is not None:
        kwargs["softcap"] = float(softcap)
    return (qsl, cu_k, max_q, max_k), kwargs


def make_paged_attention(varlen_fn: Callable[..., torch.Tensor], *, has_softcap: bool = True
                         ) -> Callable[..., torch.Tensor]:
    """Our ``paged_attention`` contract on ``varlen_fn`` (``flash_attn_varlen_func``)."""

    def paged_attention_flash_attn(
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), last stride 1
        v_cache: torch.Tensor,
        cam: CommonAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim), q's dtype
        """Same contract as ``paged_attention_ref``."""
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens != cam.num_actual_tokens:
            raise ValueError(f"q: has {num_tokens} tokens, metadata has {cam.num_actual_tokens}")
        if k_cache.shape[1:] != (cam.block_size, k_cache.shape[2], head_dim) or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"k_cache/v_cache: shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} vs q {tuple(q.shape)} "
                f"and block size {cam.block_size}")
        if num_heads % k_cache.shape[2]:
            raise ValueError(f"q: num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window: must be positive, got {sliding_window}")
        reason = unsupported_reason(q, k_cache, cam, softcap=softcap, has_softcap=has_softcap, sinks=sinks)
        if reason is not None:
            raise UnsupportedConfig(BACKEND, "paged_attention", reason)
        if num_tokens == 0:                       # FA2 refuses an empty batch
            return torch.empty_like(q)
        args, kwargs = varlen_arguments(q, cam, scale=scale, sliding_window=sliding_window, softcap=softcap)
        return varlen_fn(q, k_cache, v_cache, *args, **kwargs)

    return paged_attention_flash_attn


def flash_attn_ops() -> dict[str, Callable[..., torch.Tensor]]:
    """The ops the ``flash_attn`` backend replaces. ImportError: flash-attn missing, broken or too old."""
    from flash_attn import flash_attn_varlen_func  # the only place flash-attn is imported

    params = inspect.signature(flash_attn_varlen_func).parameters
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    if "block_table" not in params:
        raise ImportError(f"flash-attn {version}: flash_attn_varlen_func takes no block_table (paged KV needs "
                          f">= 2.5, softcap >= 2.6)")
    logger.info("flash_attn: paged_attention from flash-attn %s (flash_attn_varlen_func + block_table; block "
                "size must be a multiple of %d)", version, PAGE_MULTIPLE)
    return {"paged_attention": make_paged_attention(flash_attn_varlen_func, has_softcap="softcap" in params)}

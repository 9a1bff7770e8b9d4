"""Attention over the paged KV cache, for full, sliding-window and chunked-local layers alike.

The layer does not know its kind's cache policy: its group's builder already trimmed the block table
(sliding) or cut the batch into virtual requests (chunked), so it only applies the window mask when
told to. RoPE variants, q/k norms and Llama-4's NoPE temperature tuning happen before the KV write.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.forward_context import get_forward_context
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.norms import RMSNorm, rms_normalize
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.config import Attention


class AttentionLayer(nn.Module):
    def __init__(self, hidden_size: int, cfg: Attention, *, cache_name: str, norm_eps: float,
                 gemma_norm: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.cache_name = cache_name
        self.norm_eps = norm_eps
        if cfg.num_heads % tp_size:
            raise ValueError(f"{cache_name}: num_heads={cfg.num_heads} not divisible by tp_size={tp_size}")
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp_size)   # replicated when fewer than ranks
        d = cfg.head_dim
        self.q_proj = ColumnParallelLinear(hidden_size, cfg.num_heads * d, bias=cfg.qkv_bias, tp_size=tp_size)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, hidden_size, bias=cfg.o_bias, tp_size=tp_size)
        self.q_norm = RMSNorm(d, eps=norm_eps, gemma=gemma_norm) if cfg.qk_norm == "rms" else None
        self.k_norm = RMSNorm(d, eps=norm_eps, gemma=gemma_norm) if cfg.qk_norm == "rms" else None
        self.rotary = RotaryEmbedding(d, cfg.rope) if cfg.rope is not None else None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None   # bound by the model runner

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim) views of the block pool."""
        self.kv_cache = (k_cache, v_cache)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size); positions: (num_tokens,) absolute token positions
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
            if cfg.qk_norm == "rms_weightless":
                q = rms_normalize(q, self.norm_eps).to(x.dtype)
                k = rms_normalize(k, self.norm_eps).to(x.dtype)
        elif cfg.temperature_tuning is not None:
            attn_scale, floor_scale = cfg.temperature_tuning
            scales = 1.0 + attn_scale * torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
            q = (q * scales[:, None, None]).to(x.dtype)

        if self.kv_cache is None:
            raise RuntimeError(f"{self.cache_name}: no KV cache bound (the model runner binds it)")
        ctx = get_forward_context()
        inputs = ctx.inputs[self.cache_name]
        k_cache, v_cache = self.kv_cache
        ctx.backend.write_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        out = ctx.backend.paged_attention(q, k_cache, v_cache, inputs.cam, scale=cfg.softmax_scale,
                                          sliding_window=inputs.sliding_window, softcap=cfg.softcap)
        return self.o_proj(out.reshape(n, self.num_heads * cfg.head_dim))   # (num_tokens, hidden_size)

"""Multi-head latent attention (MLA) over a paged latent cache, in the absorbed form (HF ``KimiLinearAttention``
semantics: NoPE, the shared "rope" key part used as projected).

HF expands every cached latent into per-head keys and values (``kv_b_proj``) and attends; here the cache holds the
latent row r = [c | k_rope] (kv_lora_rank + qk_rope_head_dim, ``MLAAttentionSpec``) and the per-head up-projections
are absorbed into the query and the output, which is exact algebra (same logits, same weights), not an
approximation. With kv_b_proj's rows per head [W_uk (qk_nope_head_dim, L) | W_uv (v_head_dim, L)]:

    q_nope . (W_uk c) + q_rope . k_rope = [W_uk^T q_nope | q_rope] . [c | k_rope]     (one "head" of L + R)
    sum_j p_j (W_uv c_j) = W_uv (sum_j p_j c_j)

so attention is multi-query attention with a single KV head of width L + R whose keys and values are the same
cached rows (the output's last R channels, the values' k_rope part, are dropped), through the group's own
paged-attention op (``write_kv`` / ``paged_attention``: block tables, prefix caching and chunked prefill as for any
full-attention layer). Why absorbed: the cache stays latent (no per-head K/V anywhere, not even per step), and the
attention reads L + R channels per token instead of num_heads * (nope + rope + v).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import get_forward_context, metadata_op
from hybridkv.kv_groups.specs import KVCacheSpec, MLAAttentionSpec
from hybridkv.layers.kind import CacheContext, MixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.norms import RMSNorm
from hybridkv.layers.parallel import SINGLE, Split, TensorParallel, local_units

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class MultiLatentAttention(MixerConfig):
    """Multi-head latent attention (MLA, DeepSeek-V2) as Kimi-Linear runs it (HF ``KimiLinearAttention``): NoPE,
    so the shared "rope" key part is used as projected, never rotated.

    q = ``q_proj(x)`` (or ``q_b_proj(norm(q_a_proj(x)))`` with ``q_lora_rank``), ``num_heads`` x (qk_nope_head_dim +
    qk_rope_head_dim); ``kv_a_proj_with_mqa(x)`` = [latent c (kv_lora_rank) | k_rope (qk_rope_head_dim)], c
    RMS-normed (``kv_a_layernorm``); ``kv_b_proj(c)`` gives each head's k_nope and v (v_head_dim); softmax scale
    (qk_nope_head_dim + qk_rope_head_dim) ** -0.5. The KV cache holds [c | k_rope] per token, one row of
    kv_lora_rank + qk_rope_head_dim shared by every head (``MLAAttentionSpec``), not per-head K and V.
    ``bias``: HF's ``attention_bias`` (kv_a_proj, q_a_proj and o_proj); ``norm_eps``: the latent norms' eps (HF
    builds them with its RMS norm's default, 1e-6, not the model's ``rms_norm_eps``)."""

    ops = ("write_kv", "paged_attention")

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    bias: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_fields(self)
        positive("MultiLatentAttention", num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                 qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                 v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank, norm_eps=self.norm_eps)

    @property
    def kind(self) -> str:
        return "full"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def cache_spec(self, ctx: CacheContext) -> KVCacheSpec:      # one latent row per token, every rank whole
        return MLAAttentionSpec(block_size=ctx.block_size, kv_lora_rank=self.kv_lora_rank,
                                qk_rope_head_dim=self.qk_rope_head_dim, dtype=ctx.kv_dtype)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.num_heads, tensor_parallel_size, "num_heads")

    def matrix_elements(self, hidden: int, width: int) -> int:
        h, lat = self.num_heads, self.kv_lora_rank
        q = (hidden * h * self.qk_head_dim if self.q_lora_rank is None
             else self.q_lora_rank * (hidden + h * self.qk_head_dim))
        return (q + hidden * (lat + self.qk_rope_head_dim) + lat * h * (self.qk_nope_head_dim + self.v_head_dim)
                + h * self.v_head_dim * hidden)

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> MLALayer:
        return MLALayer(hidden_size, self, cache_name=cache_name, tp=tp)


class MLALayer(nn.Module):
    """Tensor parallel (``tp``): heads split: q_proj (or q_b_proj) and kv_b_proj column-parallel by heads, o_proj
    row-parallel; the latent path (kv_a_proj_with_mqa, kv_a_layernorm, q_a_proj, q_a_layernorm) and the latent cache
    are replicated, whole on every rank. Parameter names are the hub's."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: MultiLatentAttention, *, cache_name: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.cache_name = cache_name
        h = cfg.num_heads
        what = f"{cache_name} MultiLatentAttention.num_heads"
        self.num_heads = Split(h, h, what=what).local_size(tp.size)
        q_heads = (Split(h * cfg.qk_head_dim, h, what=what),)
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, h * cfg.qk_head_dim, tp=tp, sections=q_heads)
        else:
            self.q_a_proj = nn.Linear(hidden_size, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, h * cfg.qk_head_dim, tp=tp, sections=q_heads)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        kv_rows = cfg.qk_nope_head_dim + cfg.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, h * kv_rows, tp=tp,
                                              sections=(Split(h * kv_rows, h, what=what),))
        self.o_proj = RowParallelLinear(h * cfg.v_head_dim, hidden_size, bias=cfg.bias, tp=tp,
                                        sections=(Split(h * cfg.v_head_dim, h, what=what),))
        self.cache: torch.Tensor | None = None      # bound by the model runner

    def bind_cache(self, cache: torch.Tensor) -> None:
        """cache: (num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim), a view of the block pool."""
        self.cache = cache

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (num_tokens, hidden_size); positions unused (NoPE)."""
        cfg, n, h = self.cfg, x.shape[0], self.num_heads
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(n, h, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1).view(n, 1, -1)     # (n, 1, L + R): the cache row
        w = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)       # (h, nope, L), (h, v, L)
        q_abs = torch.cat([torch.einsum("nhd,hdl->nhl", q_nope, w_uk), q_rope], dim=-1)      # (n, h, L + R)
        o = metadata_op(self._attend, q_abs, row, shape=tuple(q_abs.shape), dtype=q_abs.dtype)
        out = torch.einsum("nhl,hvl->nhv", o[..., :cfg.kv_lora_rank], w_uv)                  # (n, h, v_head_dim)
        return self.o_proj(out.reshape(n, h * cfg.v_head_dim))

    def _attend(self, q_abs: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): this step's latent rows into the cache, attention over
        the group's blocks. q_abs: (n, heads, L + R), row: (n, 1, L + R) -> (n, heads, L + R)."""
        if self.cache is None:
            raise RuntimeError(f"{self.cache_name}: no KV cache bound (the model runner binds it)")
        ctx = get_forward_context()
        inputs = ctx.inputs[self.cache_name]
        ctx.backend.write_kv(row, row, self.cache, self.cache, inputs.slot_mapping)
        return ctx.backend.paged_attention(q_abs, self.cache, self.cache, inputs.cam, scale=self.cfg.softmax_scale)

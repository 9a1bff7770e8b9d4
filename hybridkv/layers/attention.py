"""Attention over the paged KV cache, for full, sliding-window and chunked-local layers alike.

The layer does not know its kind's cache policy: its group's builder already trimmed the block table
(sliding) or cut the batch into virtual requests (chunked), so it only applies the window mask when
told to. RoPE variants, q/k norms and Llama-4's NoPE temperature tuning happen before the KV write, in one backend
op (``qk_rope_write_kv``), or, for a decode batch, inside the attention op (``rope_attention``: on the triton
backend one kernel); q, k and v come from one packed GEMM once the runner fused the projections.

gpt-oss's attention sinks are one learned logit per query head (``sinks``, split by heads under tensor
parallelism like q), passed to the attention op; YaRN's attention factor m scales q . k by m^2
(``rotary.rope_attention_factor``), folded into the softmax scale.

Zamba2 runs one set of attention weights at several depths, each with its own KV cache: every use is an
``AttentionUse`` (the cache owner, plus its own low-rank q/k/v adapters) that borrows the shared
``AttentionLayer``'s weights without registering them, so the weights keep exactly one owner.

Qwen3-Next gates the output: q_proj gives [q | gate] per head and o_proj reads out * sigmoid(gate). OLMo's q/k
norms span all heads (``qk_norm="rms_full"``), so they run on the projections, before the per-head prep op.

Gemma-4: values are RMS-normalised per head (no weight) before the cache (``value_norm``), its global layers may
take the keys as projected for values (``k_eq_v``: no v_proj). A KV-sharing layer (``kv_source``: Gemma-3n / 4)
has no k/v projections: it prepares q alone (``qk_rope_write_kv`` with k = v = None), writes nothing, and attends
over its donor's cache, which the runner binds to it and whose group inputs it reads (the donor, an earlier layer,
wrote this step's keys before it runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import current_ops, get_forward_context, metadata_op
from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVSharingSpec,
    SlidingWindowSpec,
)
from hybridkv.layers.kind import CacheContext, MixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, LowRankAdapter, PackedLinears, RowParallelLinear
from hybridkv.layers.norms import AcrossHeadsRMSNorm, RMSNorm
from hybridkv.layers.ops.fused_ref import QKPrep
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.rotary import Rope, RotaryEmbedding, rope_attention_factor

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class Attention(MixerConfig):
    """Softmax attention over a paged KV cache: full, sliding-window or chunked-local.

    ``rope=None`` is NoPE. ``qk_norm``: None, "rms" (learned per-head-dim weight) or "rms_weightless"
    (Llama-4, applied after RoPE). ``temperature_tuning=(attn_scale, floor_scale)`` scales q on Llama-4
    NoPE layers by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)). ``shared_id`` marks layers
    that share weights (Zamba2) while keeping separate KV caches.

    "rms" q/k norms are learned per head dim, use the model's norm flavour (``HybridConfig.norm``) and
    run before RoPE (Gemma-3); "rms_weightless" runs after RoPE with ``HybridConfig.norm_eps`` (Llama-4);
    "rms_full" is one plain RMS norm over all heads' channels of q (and of k), weight (heads * head_dim,), on the
    projections before RoPE (OLMo-2/3, OLMo-Hybrid).
    ``scale`` overrides head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5; Granite:
    attention_multiplier). Falcon-H1 µP multipliers: the input is scaled by ``input_multiplier``, keys by
    ``key_multiplier`` (after k_proj, before RoPE), the output by ``output_multiplier``.

    ``sinks`` (gpt-oss): a learned logit per query head that joins every softmax's denominator and carries no
    value (``layers/ops/attention_ref.py``); a parameter of the layer, nothing in the KV cache.

    ``output_gate`` (Qwen3-Next): q_proj also gives a gate per query head (its rows per head [q | gate], as HF
    stores them); the attention output is multiplied by sigmoid(gate) before o_proj.

    Gemma-4: ``value_norm`` normalises each value head (RMS, no weight) before the cache; ``k_eq_v`` has no v_proj,
    the values are the keys as projected (before the k norm and RoPE). ``kv_source`` (cross-layer KV sharing,
    Gemma-3n / Gemma-4) is the index of an earlier layer whose KV cache this layer reads: it has only q_proj,
    q_norm and o_proj, keeps no cache and writes none (``KVSharingSpec``); kv heads, head dim and window must be
    its donor's."""

    ops = ("qk_rope_write_kv", "rope_attention", "paged_attention", "rms_norm", "act_mul")

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    rope: Rope | None = Rope()
    qk_norm: str | None = None
    scale: float | None = None
    softcap: float | None = None
    temperature_tuning: tuple[float, float] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    shared_id: int | None = None
    input_multiplier: float = 1.0
    key_multiplier: float = 1.0
    output_multiplier: float = 1.0
    sinks: bool = False
    output_gate: bool = False
    value_norm: bool = False
    k_eq_v: bool = False
    kv_source: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.kv_source is not None and self.kv_source < 0:
            raise ValueError(f"Attention.kv_source must be a layer index >= 0, got {self.kv_source}")
        if self.kv_source is not None and self.k_eq_v:
            raise ValueError("Attention: a KV-sharing layer (kv_source) has no k/v projections; k_eq_v does not apply")
        positive("Attention", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim, sliding_window=self.sliding_window,
                 attention_chunk_size=self.attention_chunk_size, scale=self.scale, softcap=self.softcap)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Attention.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError("Attention: set sliding_window or attention_chunk_size, not both")
        if self.qk_norm not in (None, "rms", "rms_weightless", "rms_full"):
            raise ValueError(f"Attention.qk_norm must be None, 'rms', 'rms_weightless' or 'rms_full', "
                             f"got {self.qk_norm!r}")

    @property
    def kind(self) -> str:
        if self.sliding_window is not None:
            return "sliding_window"
        return "chunked_local" if self.attention_chunk_size is not None else "full"

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    def cache_spec(self, ctx: CacheContext) -> KVCacheSpec:
        if self.kv_source is not None:          # reads its donor's cache, keeps none of its own
            donor, target = ctx.layer_cache(self.kv_source)
            return KVSharingSpec(block_size=ctx.block_size, donor=donor, target=target)
        kv_heads = local_units(self.num_kv_heads, ctx.tensor_parallel_size, "num_kv_heads", replicate=True)
        common = dict(block_size=ctx.block_size, num_kv_heads=kv_heads, head_size=self.head_dim, dtype=ctx.kv_dtype)
        if self.sliding_window is not None and self.sliding_window < ctx.max_positions:
            return SlidingWindowSpec(sliding_window=self.sliding_window, **common)
        if self.attention_chunk_size is not None and self.attention_chunk_size < ctx.max_positions:
            return ChunkedLocalAttentionSpec(attention_chunk_size=self.attention_chunk_size, **common)
        return FullAttentionSpec(**common)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.num_heads, tensor_parallel_size, "num_heads")
        local_units(self.num_kv_heads, tensor_parallel_size, "num_kv_heads", replicate=True)

    def matrix_elements(self, hidden: int, width: int) -> int:
        # a KV-sharing layer has no k/v projections; k = v: no v projection
        kv = 0 if self.kv_source is not None else (1 if self.k_eq_v else 2) * self.num_kv_heads
        return self.head_dim * (width * (self.num_heads + kv) + self.num_heads * hidden)

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> AttentionLayer:
        return AttentionLayer(hidden_size, self, cache_name=cache_name, norm_eps=model_config.norm_eps,
                              gemma_norm=model_config.norm == "gemma_rms", tp=tp)


class AttentionLayer(nn.Module):
    """``hidden_size`` is the input width; ``out_size`` (default: the same) the output width (Zamba2's
    shared attention reads concat(hidden, embeddings), 2 * hidden wide, and writes hidden)."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: Attention, *, cache_name: str, norm_eps: float,
                 gemma_norm: bool = False, tp: TensorParallel = SINGLE, out_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.cache_name = cache_name
        d = cfg.head_dim
        # Tensor parallel: q heads split; kv heads split, or replicated when fewer than ranks (each rank keeps
        # the kv head its q heads read); o_proj sums the heads' partial outputs.
        # Qwen3-Next's output gate: q_proj rows per head are [q | gate], so the heads still split whole.
        q_rows = cfg.num_heads * d * (2 if cfg.output_gate else 1)
        self.q_sections = (Split(q_rows, cfg.num_heads, what=f"{cache_name} Attention.num_heads"),)
        o_sections = (Split(cfg.num_heads * d, cfg.num_heads, what=f"{cache_name} Attention.num_heads"),)
        self.kv_sections = (Split(cfg.num_kv_heads * d, cfg.num_kv_heads, replicate=True,
                                  what=f"{cache_name} Attention.num_kv_heads"),)
        self.num_heads = o_sections[0].local_size(tp.size) // d
        self.num_kv_heads = self.kv_sections[0].local_size(tp.size) // d
        self.shares_kv = cfg.kv_source is not None         # reads an earlier layer's cache; no k/v of its own
        self.q_proj = ColumnParallelLinear(hidden_size, q_rows, bias=cfg.qkv_bias, tp=tp,
                                           sections=self.q_sections)
        self.k_proj = None if self.shares_kv else ColumnParallelLinear(
            hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias, tp=tp, sections=self.kv_sections)
        self.v_proj = None if self.shares_kv or cfg.k_eq_v else ColumnParallelLinear(
            hidden_size, cfg.num_kv_heads * d, bias=cfg.qkv_bias, tp=tp, sections=self.kv_sections)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, out_size or hidden_size, bias=cfg.o_bias, tp=tp,
                                        sections=o_sections)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm == "rms":
            self.q_norm = RMSNorm(d, eps=norm_eps, gemma=gemma_norm)
            self.k_norm = None if self.shares_kv else RMSNorm(d, eps=norm_eps, gemma=gemma_norm)
        elif cfg.qk_norm == "rms_full":              # over all heads: outside the per-head q/k prep op
            self.q_norm = AcrossHeadsRMSNorm(o_sections[0], eps=norm_eps, tp=tp)
            self.k_norm = None if self.shares_kv else AcrossHeadsRMSNorm(self.kv_sections[0], eps=norm_eps, tp=tp)
        self.norm_eps = norm_eps
        if cfg.value_norm and not self.shares_kv:   # the weightless value norm as the backend's rms_norm op
            self.register_buffer("v_norm_weight", torch.ones(d), persistent=False)
        self.rotary = RotaryEmbedding(d, cfg.rope) if cfg.rope is not None else None
        # YaRN's m on cos and sin is m^2 on q . k when every channel rotates; with a partial rotation the
        # pass-through channels would keep scale 1, which no single softmax scale can express.
        m = rope_attention_factor(cfg.rope) if cfg.rope is not None else 1.0
        if m != 1.0 and self.rotary.rot_dim != d:
            raise ValueError(f"{cache_name}: a YaRN attention factor ({m}) with partial rotary "
                             f"({self.rotary.rot_dim} of {d} channels) is not supported")
        self.scale = cfg.softmax_scale * m * m
        heads = (Split(cfg.num_heads, cfg.num_heads, what=f"{cache_name} Attention.num_heads"),)
        self.sinks = nn.Parameter(torch.zeros(heads[0].local_size(tp.size))) if cfg.sinks else None
        self.tp_shards = {"sinks": Shard(0, heads)} if cfg.sinks else {}
        self.prep = QKPrep(head_dim=d, rot_dim=self.rotary.rot_dim if self.rotary is not None else 0,
                           interleaved=cfg.rope is not None and cfg.rope.interleaved,
                           qk_norm=None if cfg.qk_norm == "rms_full" else cfg.qk_norm,
                           gemma_norm=gemma_norm, eps=norm_eps, temperature_tuning=cfg.temperature_tuning)
        self.packed: PackedLinears | None = None          # q|k|v as one GEMM (``fuse_projections``)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None   # bound by the model runner

    def fuse_projections(self) -> None:
        """Pack q/k/v into one weight (views keep the parameters): one GEMM per step instead of three."""
        if self.packed is not None and self.packed.valid():
            return                                  # already packed: packing again would move the weights
        projections = self._projections()
        if len(projections) > 1 and PackedLinears.can_pack(*projections):
            self.packed = PackedLinears(*projections)

    def _projections(self) -> list[ColumnParallelLinear]:
        return [p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None]

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim) views of the block pool."""
        self.kv_cache = (k_cache, v_cache)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, use: AttentionUse | None = None
                ) -> torch.Tensor:
        """x: (num_tokens, hidden_size); positions: (num_tokens,) absolute token positions. ``use``: the
        shared-weight use running this step (its cache and adapters), else this layer's own cache."""
        cfg, n = self.cfg, x.shape[0]
        owner = use if use is not None else self
        if cfg.input_multiplier != 1.0:
            x = x * cfg.input_multiplier
        if self.packed is not None and self.packed.valid():
            outs = self.packed(x)
        else:
            outs = [p(x) for p in self._projections()]
        q, k, v = (outs + [None, None])[:3]
        if cfg.k_eq_v:                      # values: the keys as projected, before the k norm and RoPE
            v = k
        if use is not None and use.q_adapter is not None:
            q, k, v = q + use.q_adapter(x), k + use.k_adapter(x), v + use.v_adapter(x)
        if cfg.key_multiplier != 1.0 and k is not None:       # Falcon-H1: on the projected keys, before RoPE
            k = k * cfg.key_multiplier
        gate = None
        if cfg.output_gate:          # views: the kernels take q's head strides (the gate's rows copy past one token)
            q, gate = q.view(n, self.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        if cfg.qk_norm == "rms_full":
            q, k = self.q_norm(q.reshape(n, -1)), self.k_norm(k)
        q = q.view(n, self.num_heads, cfg.head_dim)
        if k is not None:
            k = k.view(n, self.num_kv_heads, cfg.head_dim)
            v = v.view(n, self.num_kv_heads, cfg.head_dim)
        if k is not None and cfg.value_norm:
            v = current_ops().rms_norm(v.reshape(-1, cfg.head_dim), self.v_norm_weight,
                                       eps=self.norm_eps).view(n, self.num_kv_heads, cfg.head_dim)
        tensors = (q, positions) if k is None else (q, positions, k, v)
        out = metadata_op(partial(self._attend, owner), *tensors, shape=(n, self.num_heads, cfg.head_dim),
                          dtype=q.dtype, key=owner.cache_name)
        if gate is not None:                # out * sigmoid(gate), one launch; (n * heads, head_dim) rows
            out = current_ops().act_mul(gate.reshape(-1, cfg.head_dim), activation="sigmoid",
                                        up=out.reshape(-1, cfg.head_dim))
        out = self.o_proj(out.reshape(n, self.num_heads * cfg.head_dim))        # (num_tokens, out_size)
        return out * cfg.output_multiplier if cfg.output_multiplier != 1.0 else out

    def _attend(self, owner: AttentionLayer | AttentionUse, q: torch.Tensor, positions: torch.Tensor,
                k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): RoPE, this step's keys and values into ``owner``'s
        cache (none without k: KV sharing), attention over its blocks. q: (n, heads, head_dim), k and v:
        (n, kv_heads, head_dim) -> (n, heads, head_dim)."""
        cfg = self.cfg
        ctx = get_forward_context()
        if owner.kv_cache is None:
            raise RuntimeError(f"{owner.cache_name}: no KV cache bound (the model runner binds it)")
        inputs = ctx.inputs[owner.cache_name]
        k_cache, v_cache = owner.kv_cache
        prep = dict(prep=self.prep, inv_freq=self.rotary.inv_freq if self.rotary is not None else None,
                    q_norm_weight=self.q_norm.weight if cfg.qk_norm == "rms" else None,
                    k_norm_weight=self.k_norm.weight if cfg.qk_norm == "rms" and self.k_norm is not None else None,
                    k_cache=k_cache, v_cache=v_cache, slot_mapping=inputs.slot_mapping)
        attend = dict(scale=self.scale, sliding_window=inputs.sliding_window, softcap=cfg.softcap, sinks=self.sinks)
        if k is None:                           # KV sharing: q alone, then the donor's keys and values
            q = ctx.backend.qk_rope_write_kv(q, None, None, positions, **prep)
            return ctx.backend.paged_attention(q, k_cache, v_cache, inputs.cam, **attend)
        if inputs.cam.max_query_len <= 1:       # decode: one op, one launch on the triton backend
            return ctx.backend.rope_attention(q, k, v, positions, cam=inputs.cam, **prep, **attend)
        # prefill: the backend's own attention (flash-attn's if asked for)
        q = ctx.backend.qk_rope_write_kv(q, k, v, positions, **prep)
        return ctx.backend.paged_attention(q, k_cache, v_cache, inputs.cam, **attend)


class AttentionUse(nn.Module):
    """One use of a shared ``AttentionLayer``: owns a KV cache (``cache_name``) and, with
    ``adapter_rank`` > 0, low-rank adapters added to q, k and v. The shared layer is held in a tuple so
    it is not registered here: its weights are saved, loaded and moved once, through their owner."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, shared: AttentionLayer, *, cache_name: str, adapter_rank: int = 0) -> None:
        super().__init__()
        self._shared = (shared,)
        self.cfg = shared.cfg
        self.cache_name = cache_name
        self.num_kv_heads = shared.num_kv_heads
        width, tp = shared.q_proj.in_features, shared.q_proj.tp

        def make(sections: tuple[Split, ...]) -> LowRankAdapter | None:
            if not adapter_rank:
                return None
            return LowRankAdapter(width, adapter_rank, sections[0].size, tp=tp, sections=sections)

        self.q_adapter = make(shared.q_sections)
        self.k_adapter = make(shared.kv_sections)
        self.v_adapter = make(shared.kv_sections)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None   # bound by the model runner

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.kv_cache = (k_cache, v_cache)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._shared[0](x, positions, use=self)

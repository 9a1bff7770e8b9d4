"""References for the fused elementwise ops a decoder layer runs between its GEMMs.

Each op is what the layers computed inline before (and still compute on the ``torch`` backend), with HF's
rounding points: results are rounded to the model dtype wherever HF rounds. The ``triton`` backend fuses
each into one kernel (``backends/triton_fused.py``) with the same signature:

- ``rms_norm`` / ``add_rms_norm``: the residual add (with an optional post-norm and residual multiplier on
  the branch output) and the next pre-norm, one pass over the hidden state;
- ``act_mul``: the gated MLP's ``act(gate) * up`` over the packed gate|up projection (or ``act(x)``);
- ``linear`` / ``linear_act_mul``: a projection (``F.linear``), and one followed by ``act_mul`` (the Triton
  backend runs both as one weight-streaming kernel at decode sizes, ``backends/triton_linear.py``);
- ``argmax`` / ``linear_argmax``: greedy tokens from logits, and the logits head with them (the Triton
  backend takes each column block's maximum in the head's epilogue, ``backends/triton_sampling.py``);
- ``qk_rope_write_kv``: q/k norms, RoPE, Llama-4's post-RoPE norm or NoPE temperature tuning, and the
  K/V write into the paged cache;
- ``rope_attention``: ``qk_rope_write_kv`` then ``paged_attention`` (the Triton backend runs a decode batch's
  as one kernel: the attention programs prepare their own q, and the one that reads the new key writes it);
- ``gated_rms_norm``: Mamba2's ``norm(y * silu(z))`` per group (or ``y * silu(z)`` without a norm weight);
- ``moe_route``: a router's expert choice and routing weights from its logits (top-k, scoring, bias,
  renormalisation, scaling), which torch runs as ~5 small launches per MoE layer; ``linear_moe_route``: the
  router's projection and the routing (the Triton backend runs a decode batch's as one kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from hybridkv.layers.activations import get_activation
from hybridkv.layers.ops.attention_ref import paged_attention_ref, write_kv_ref
from hybridkv.layers.ops.registry import reference_op
from hybridkv.metadata import CommonAttentionMetadata


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (Llama-4's weightless qk-norm is exactly this)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def gated_addend(addend: torch.Tensor | None, gate_logit: torch.Tensor | None) -> torch.Tensor | None:
    """``addend * sigmoid(gate_logit)`` in the addend's dtype (Qwen3-Next's gated shared expert: (T, dim) times
    (T, 1) logits), or ``addend`` without a gate."""
    return addend if addend is None or gate_logit is None else addend * torch.sigmoid(gate_logit)


def moe_combine_ref(y: torch.Tensor, *, k: int, out_dtype: torch.dtype, positions: torch.Tensor | None = None,
                    weights: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                    addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' per-slot outputs -> the layer's (T, dim): row ``positions[t * k + j]`` of y (row
    t * k + j without ``positions``) is token t's slot j; times ``weights`` (T, k) fp32 when given, summed over
    the slots in fp32, rounded to ``out_dtype``, plus the (gated) addend (``gated_addend``), rounded again."""
    rows = (y if positions is None else y.index_select(0, positions)).float()          # (T*k, dim)
    if weights is not None:
        rows = rows * weights.reshape(-1, 1)
    out = rows.view(-1, k, y.shape[-1]).sum(1).to(out_dtype)
    return out if addend is None else out + gated_addend(addend, addend_gate)


def layer_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / std over the last dim, in fp32 (Cohere's bias-free LayerNorm before its weight)."""
    xf = x.float()
    centered = xf - xf.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)


@reference_op("rms_norm")
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, *, eps: float, gemma: bool = False,
                 centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim. Plain: ``w * normed.to(dtype)`` (cast, then scale, as Llama); Gemma:
    ``(normed * (1 + w)).to(dtype)`` (scale in fp32, then cast). ``centered``: a LayerNorm without bias
    (the mean subtracted first; Cohere), ``(normed * w).to(dtype)`` (scale in fp32, then cast)."""
    if centered:
        return (layer_normalize(x, eps) * weight.float()).to(x.dtype)
    normed = rms_normalize(x, eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


@reference_op("add_rms_norm")
def add_rms_norm_ref(delta: torch.Tensor, residual: torch.Tensor, *, weight: torch.Tensor | None, eps: float,
                     gemma: bool = False, delta_weight: torch.Tensor | None = None, scale: float = 1.0,
                     centered: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``residual + scale * post_norm(delta)``, then the next pre-norm of it.

    delta: (num_tokens, hidden) a branch output in the model dtype; residual: (num_tokens, hidden), the model
    dtype or fp32 (``residual_in_fp32``). ``delta_weight``: a post-norm on the branch (Gemma's sandwich
    norms); ``weight``: the next norm, None for none. Returns (normed in ``weight``'s dtype or None, the new
    residual in the residual's dtype). The norm reads the residual rounded to the model dtype, as HF does."""
    if delta_weight is not None:
        delta = rms_norm_ref(delta, delta_weight, eps=eps, gemma=gemma, centered=centered)
    if scale != 1.0:
        delta = delta * scale
    residual = residual + delta
    if weight is None:
        return None, residual
    return rms_norm_ref(residual.to(weight.dtype), weight, eps=eps, gemma=gemma, centered=centered), residual


@reference_op("act_mul")
def act_mul_ref(x: torch.Tensor, *, activation: str, gated: bool = True, gate_multiplier: float = 1.0,
                up: torch.Tensor | None = None) -> torch.Tensor:
    """Gated: x = gate|up (num_tokens, 2 * inter) -> ``act(gate * gate_multiplier) * up`` (num_tokens, inter), or
    x the gate alone beside a separate ``up`` of x's shape; not gated: ``act(x)``. Each step rounds to x's dtype,
    as the unfused torch ops do."""
    act = get_activation(activation)
    if up is not None and (not gated or up.shape != x.shape):
        raise ValueError(f"act_mul: up must be a gated input's {tuple(x.shape)}, got {tuple(up.shape)} "
                         f"(gated={gated})")
    if not gated:
        return act(x)
    gate, up = x.chunk(2, dim=-1) if up is None else (x, up)
    if gate_multiplier != 1.0:
        gate = gate * gate_multiplier
    return act(gate) * up


@reference_op("linear")
def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (num_tokens, in_features), weight (out_features, in_features) -> (num_tokens, out_features), rounded
    to x's dtype, then converted to ``out_dtype`` if given (fp32 logits: the kernel stores them directly)."""
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


NONFINITE = -2
"""What a greedy op's ``report`` holds for a row whose chosen (maximum) logit is not finite: NaN, or +-inf."""


@reference_op("argmax")
def argmax_ref(logits: torch.Tensor, *, out: torch.Tensor | None = None, report: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Greedy tokens: logits (rows, vocab) -> (rows,) int64, each row's first maximum (NaN above every number,
    as ``torch.argmax``), written into ``out`` when given (a captured graph's persistent buffer). ``report``
    (rows,) int64, when given, receives the tokens with ``NONFINITE`` where the chosen logit is not finite (a
    NaN anywhere in the row is chosen, so that is any NaN, or an infinite maximum)."""
    tokens = logits.argmax(-1)
    if out is not None:
        tokens = out.copy_(tokens)
    if report is not None:
        chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
        report.copy_(torch.where(torch.isfinite(chosen), tokens, NONFINITE))
    return tokens


@reference_op("linear_argmax")
def linear_argmax_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      out: torch.Tensor | None = None, write_logits: torch.Tensor | None = None,
                      report: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits head of a greedy step: fp32 logits ``linear_ref(x, weight, bias, out_dtype=fp32)`` and
    ``argmax_ref`` of them (``out``, ``report`` as there). ``write_logits``: a device scalar; where it is zero an
    implementation may leave the logits unwritten (their contents are then unspecified; this one always writes
    them)."""
    logits = linear_ref(x, weight, bias, out_dtype=torch.float32)
    return logits, argmax_ref(logits, out=out, report=report)


@reference_op("linear_act_mul")
def linear_act_mul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, activation: str,
                       gated: bool = True, gate_multiplier: float = 1.0) -> torch.Tensor:
    """``act_mul_ref(F.linear(x, weight, bias))``: weight is the packed gate|up (2 * inter, in_features) when
    gated -> (num_tokens, inter)."""
    return act_mul_ref(F.linear(x, weight, bias), activation=activation, gated=gated, gate_multiplier=gate_multiplier)


@dataclass(frozen=True, kw_only=True)
class QKPrep:
    """What happens to q and k between their projection and the cache, in this order: a learned per-head
    RMS norm (``qk_norm="rms"``), RoPE on the first ``rot_dim`` channels (0: NoPE), Llama-4's weightless
    norm after RoPE (``qk_norm="rms_weightless"``, RoPE layers only), and on NoPE layers Llama-4's query
    temperature ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``."""

    head_dim: int
    rot_dim: int = 0
    interleaved: bool = False
    qk_norm: str | None = None
    gemma_norm: bool = False
    eps: float = 1e-6
    temperature_tuning: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rot_dim <= self.head_dim or self.rot_dim % 2:
            raise ValueError(f"QKPrep: rot_dim {self.rot_dim} must be even and in [0, head_dim={self.head_dim}]")
        if self.qk_norm not in (None, "rms", "rms_weightless"):
            raise ValueError(f"QKPrep: unknown qk_norm {self.qk_norm!r}")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, rot_dim: int,
               interleaved: bool) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of x (num_tokens, heads, head_dim) in fp32; cast back."""
    freqs = positions.float()[:, None] * inv_freq[None, :]          # (num_tokens, rot_dim // 2)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    if interleaved:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        out = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


@reference_op("qk_rope_write_kv")
def qk_rope_write_kv_ref(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_dim); None: q only (a KV-sharing layer)
    v: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (num_tokens,) absolute positions
    *,
    prep: QKPrep,
    inv_freq: torch.Tensor | None,  # (rot_dim // 2,) fp32, with rot_dim > 0
    q_norm_weight: torch.Tensor | None,  # (head_dim,), with qk_norm == "rms"
    k_norm_weight: torch.Tensor | None,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,)
) -> torch.Tensor:
    """q and k prepared as ``prep`` says; k and v written at their slots (``k`` and ``v`` None: q alone, nothing
    written). Returns q (num_tokens, num_heads, head_dim) in q's dtype."""
    dtype = q.dtype
    if (k is None) != (v is None):
        raise ValueError("qk_rope_write_kv: k and v are both given or both None")
    if prep.qk_norm == "rms":
        q = rms_norm_ref(q, q_norm_weight, eps=prep.eps, gemma=prep.gemma_norm)
        k = rms_norm_ref(k, k_norm_weight, eps=prep.eps, gemma=prep.gemma_norm) if k is not None else None
    if prep.rot_dim:
        q = apply_rope(q, positions, inv_freq, rot_dim=prep.rot_dim, interleaved=prep.interleaved)
        k = apply_rope(k, positions, inv_freq, rot_dim=prep.rot_dim, interleaved=prep.interleaved) \
            if k is not None else None
        if prep.qk_norm == "rms_weightless":
            q = rms_normalize(q, prep.eps).to(dtype)
            k = rms_normalize(k, prep.eps).to(dtype) if k is not None else None
    elif prep.temperature_tuning is not None:
        attn_scale, floor_scale = prep.temperature_tuning
        scales = 1.0 + attn_scale * torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
        q = (q * scales[:, None, None]).to(dtype)
    if k is not None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def compose_rope_attention(qk_rope_write_kv: Callable[..., torch.Tensor], paged_attention: Callable[..., torch.Tensor]
                           ) -> Callable[..., torch.Tensor]:
    """``rope_attention`` as its two ops, one after the other (the reference, and backends without a fused
    kernel)."""

    def rope_attention(
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), as projected
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        positions: torch.Tensor,  # (num_tokens,) absolute positions
        *,
        prep: QKPrep,
        inv_freq: torch.Tensor | None,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # (num_tokens,)
        cam: CommonAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q and k prepared and k, v written as ``qk_rope_write_kv``, then ``paged_attention`` of q over the
        cache: (num_tokens, num_heads, head_dim). ``sinks``: (num_heads,) sink logits, or None."""
        q = qk_rope_write_kv(q, k, v, positions, prep=prep, inv_freq=inv_freq, q_norm_weight=q_norm_weight,
                             k_norm_weight=k_norm_weight, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
        return paged_attention(q, k_cache, v_cache, cam, scale=scale, sliding_window=sliding_window, softcap=softcap,
                               sinks=sinks)

    return rope_attention


rope_attention_ref = reference_op("rope_attention")(compose_rope_attention(qk_rope_write_kv_ref,
                                                                                 paged_attention_ref))


@reference_op("gated_rms_norm")
def gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, *, n_groups: int = 1,
                       eps: float = 1e-5, norm_before_gate: bool = False) -> torch.Tensor:
    """Mamba2's output gate. y, z: (num_tokens, dim). ``norm(y * silu(z))`` with the RMS taken over each of
    ``n_groups`` groups of ``dim // n_groups`` channels; ``norm_before_gate``: ``norm(y) * silu(z)`` (weight and
    gate applied in fp32 before the cast). ``weight`` None: no norm, ``y * silu(z)``."""
    gate = F.silu(z.float())
    if weight is None:
        return (y.float() * gate).to(y.dtype)
    gated = y.float() if norm_before_gate else y.float() * gate
    grouped = gated.view(*gated.shape[:-1], n_groups, -1)
    normed = rms_normalize(grouped, eps).view_as(gated)
    if norm_before_gate:
        return (weight.float() * normed * gate).to(y.dtype)
    return weight * normed.to(y.dtype)


ROUTERS = ("softmax", "sigmoid_input", "sigmoid_bias", "topk_softmax")


@reference_op("moe_route")
def moe_route_ref(logits: torch.Tensor, *, router: str, top_k: int, renormalize: bool = False,
                  scaling: float = 1.0, correction_bias: torch.Tensor | None = None, num_groups: int = 1,
                  topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (num_tokens, num_experts), any float dtype -> (expert ids int64, fp32 weights), both
    (num_tokens, top_k), best first. ``router`` (``models.config.MoE``): "softmax" (top-k of the softmax,
    renormalised if asked), "sigmoid_input" (Llama-4: sigmoid of the top-k logits), "topk_softmax" (gpt-oss:
    softmax over the top-k logits; ``renormalize`` changes nothing), "sigmoid_bias" (NemotronH:
    sigmoid scores, chosen by score + ``correction_bias`` among the ``topk_groups`` best of ``num_groups``
    expert groups (group score: its two best corrected scores), weights renormalised if asked). Weights are
    multiplied by ``scaling`` last."""
    if router not in ROUTERS:
        raise ValueError(f"moe_route: router must be one of {ROUTERS}, got {router!r}")
    logits = logits.float()
    if router == "softmax":
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    elif router == "sigmoid_input":
        top, ids = logits.topk(top_k, dim=-1)
        weights = top.sigmoid()
    elif router == "topk_softmax":
        top, ids = logits.topk(top_k, dim=-1)
        weights = top.softmax(-1)
    else:
        if correction_bias is None:
            raise ValueError("moe_route: the 'sigmoid_bias' router needs correction_bias")
        scores = logits.sigmoid()
        choice = scores + correction_bias.float()
        if topk_groups < num_groups:
            grouped = choice.view(choice.shape[0], num_groups, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_scores.topk(topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(1)
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, (weights * scaling if scaling != 1.0 else weights)


@reference_op("linear_moe_route")
def linear_moe_route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         num_experts: int, router: str, top_k: int, renormalize: bool = False, scaling: float = 1.0,
                         correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear`` then ``moe_route`` of its first ``num_experts`` columns: x (T, hidden), weight (N >= num_experts,
    hidden) -> (expert ids, fp32 weights, logits (T, N) in x's dtype); columns past the experts ride along
    (Qwen3-Next's shared-expert gate, packed with the router)."""
    logits = linear_ref(x, weight, bias)
    ids, weights = moe_route_ref(logits[:, :num_experts], router=router, top_k=top_k, renormalize=renormalize,
                                 scaling=scaling, correction_bias=correction_bias, num_groups=num_groups,
                                 topk_groups=topk_groups)
    return ids, weights, logits

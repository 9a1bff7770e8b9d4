"""Rotary position embeddings: rotate-half (NeoX) and interleaved-pair (Llama-4) layouts, partial
rotary, linear, llama3, YaRN and Gemma-4's proportional frequencies. Cos/sin are computed per call from ``positions``
(cheap next to attention) so there is no max-length table to size or overflow.

YaRN also scales cos and sin by an attention factor m (HF multiplies both tables by it, so q . k grows by
m^2 on the rotated channels). ``rope_attention_factor`` returns m; the attention layer folds m^2 into its
softmax scale, which is exact when every channel rotates (gpt-oss) and refused otherwise. The config, ``Rope``, is
here: an attention layer's config holds one, so it sits below the layers (``models.config`` re-exports it)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.config_base import check_fields, positive
from hybridkv.layers.ops.fused_ref import apply_rope

ROPE_SCALINGS = (None, "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True, kw_only=True)
class Rope:
    """Rotary embedding. ``interleaved`` rotates pairs (x[2i], x[2i+1]) (Llama-4, GPT-J); otherwise
    the halves are rotated (NeoX / Llama / Mistral / Gemma). ``scaling``: None, "linear", "llama3" or "yarn".

    YaRN (gpt-oss) reads ``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` (the
    ramp between interpolated and extrapolated frequencies), ``truncate`` (round the ramp's ends to whole
    dims) and the attention factor: ``attention_factor``, else from ``mscale`` / ``mscale_all_dim`` when both are
    set, else ``0.1 ln(factor) + 1`` (HF's ``_compute_yarn_parameters``; ``layers/rotary.py``).

    "proportional" (Gemma-4's global layers): the halves of the whole head are rotated, but only the first
    ``partial_rotary_factor * head_dim / 2`` frequencies are non-zero (``1 / theta^(2i / head_dim)``, divided by
    ``factor``); the rest rotate by 0, i.e. pass through (HF's ``_compute_proportional_rope_parameters``)."""

    theta: float = 10000.0
    interleaved: bool = False
    partial_rotary_factor: float = 1.0
    scaling: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        positive("Rope", theta=self.theta, factor=self.factor, low_freq_factor=self.low_freq_factor,
                 high_freq_factor=self.high_freq_factor,
                 original_max_position_embeddings=self.original_max_position_embeddings)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"Rope.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"Rope.scaling must be one of {ROPE_SCALINGS}, got {self.scaling!r}")
        positive("Rope", beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                 attention_factor=self.attention_factor)


def rope_inv_freq(rope: Rope, rot_dim: int) -> torch.Tensor:
    """Inverse frequencies (rot_dim // 2,) with the configured scaling applied, computed in fp32 exactly
    as HF does (an fp64 table differs by an ulp, which is a visible phase error at long positions)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if rope.scaling == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq, scaled)
    elif rope.scaling == "yarn":
        inv_freq = _yarn_inv_freq(rope, rot_dim)
    elif rope.scaling == "proportional":
        inv_freq = _proportional_inv_freq(rope, rot_dim)
    return inv_freq


def _proportional_inv_freq(rope: Rope, head_dim: int) -> torch.Tensor:
    """HF's ``_compute_proportional_rope_parameters`` (Gemma-4): ``head_dim // 2`` frequencies over the whole head,
    the first ``int(partial_rotary_factor * head_dim // 2)`` of them ``1 / theta^(2i / head_dim)`` and the rest 0
    (those channel pairs rotate by nothing), all divided by ``factor``."""
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat((rotated, torch.zeros(head_dim // 2 - angles))) / rope.factor


def _yarn_inv_freq(rope: Rope, dim: int) -> torch.Tensor:
    """HF's ``_compute_yarn_parameters`` inverse frequencies, op for op (fp32): extrapolated (1 / base^(2i/d))
    below the ``beta_fast`` rotation count, interpolated (divided by ``factor``) above ``beta_slow``, a linear
    ramp over the dims between."""
    base, factor = rope.theta, rope.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                    # HF: prevents a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope: Rope) -> float:
    """YaRN's factor m on cos and sin (1.0 for the other scalings): ``attention_factor`` when given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor)``, with
    ``mscale(s, m) = 0.1 m ln(s) + 1`` (1 for s <= 1), as HF computes it."""
    if rope.scaling != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: Rope) -> None:
        super().__init__()
        # proportional RoPE rotates the whole head; its partial factor zeroes frequencies instead
        self.rot_dim = head_dim if rope.scaling == "proportional" else int(head_dim * rope.partial_rotary_factor)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dim {self.rot_dim} (head_dim {head_dim} x partial_rotary_factor "
                             f"{rope.partial_rotary_factor}) must be even")
        self.interleaved = rope.interleaved
        self.register_buffer("inv_freq", rope_inv_freq(rope, self.rot_dim), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Follow device moves but stay fp32 through dtype casts: a bf16 frequency table is off by up to
        ~0.4% per frequency, i.e. whole radians of phase at long positions (HF keeps it fp32 too)."""
        table = self.inv_freq
        super()._apply(fn, recurse)
        if not table.is_meta and self.inv_freq.dtype != torch.float32:
            self.inv_freq = table.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (num_tokens,); q: (num_tokens, num_heads, head_dim); k: (num_tokens, kv_heads, head_dim)
        kw = dict(rot_dim=self.rot_dim, interleaved=self.interleaved)
        return apply_rope(q, positions, self.inv_freq, **kw), apply_rope(k, positions, self.inv_freq, **kw)

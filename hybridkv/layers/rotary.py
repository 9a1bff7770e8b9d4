"""Rotary position embeddings: rotate-half (NeoX) and interleaved-pair (Llama-4) layouts, partial
rotary, linear and llama3 frequency scaling. Cos/sin are computed per call from ``positions``
(cheap next to attention) so there is no max-length table to size or overflow."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from hybridkv.layers.ops.fused_ref import apply_rope
from hybridkv.models.config import Rope


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
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: Rope) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * rope.partial_rotary_factor)
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

"""Batched sampling: temperature, top-k, top-p, min-p, greedy, logprobs — one pass for the whole batch.

Randomness is counter-based: the noise for request r at output index i is a hash of (seed_r, i, token),
so a request's samples depend on its own seed only, never on what else shares the batch or on how
steps were cut (reproducible per request, and no per-request generator loop on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)   # splitmix64 constants as signed int64
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic; logical shifts emulated)."""
    mask = lambda s: (1 << (64 - s)) - 1  # noqa: E731
    x = (x ^ ((x >> 30) & mask(30))) * _M2
    x = (x ^ ((x >> 27) & mask(27))) * _M3
    return x ^ ((x >> 31) & mask(31))


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(batch, vocab) uniforms in (0, 1) from per-row (seed, counter); deterministic on any device."""
    base = _mix(seeds.long() * _M1 + counters.long())                       # (batch,)
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.long)
    bits = _mix(base[:, None] + cols[None, :] * _M1)
    top53 = (bits >> 11) & ((1 << 53) - 1)
    return (top53.double() + 0.5) / float(1 << 53)


@dataclass(frozen=True, kw_only=True)
class SamplingTensors:
    """Per-row parameters of one step, as device tensors (built once per step by the engine)."""

    temperature: torch.Tensor   # (batch,) float32; 0 = greedy
    top_k: torch.Tensor         # (batch,) int64; 0 = disabled
    top_p: torch.Tensor         # (batch,) float32
    min_p: torch.Tensor         # (batch,) float32
    seeds: torch.Tensor         # (batch,) int64
    counters: torch.Tensor      # (batch,) int64: index of the token being sampled in its sequence
    needs_filtering: bool       # any top-k / top-p / min-p in the batch


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """(batch, vocab) fp32 logits -> (batch,) sampled token ids."""
    greedy = params.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if params.needs_filtering:
        scaled = _filter(scaled, params)
    gumbel = -torch.log(-torch.log(uniform_noise(params.seeds, params.counters, logits.shape[-1])))
    sampled = (scaled + gumbel.to(scaled.dtype)).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)


def _filter(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Mask to -inf what top-k, top-p and min-p exclude (each disabled per row by its neutral value)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(params.top_k > 0, params.top_k, vocab)[:, None]
    drop = rank >= k
    probs = sorted_logits.softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p is kept)
    drop |= (probs.cumsum(-1) - probs) >= params.top_p[:, None]
    drop |= probs < params.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, masked)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, top: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of the raw logits: (chosen (batch,), top values (batch, top), top ids (batch, top))."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, token_ids[:, None]).squeeze(-1)
    values, ids = logp.topk(top, dim=-1) if top > 0 else (logp[:, :0], token_ids[:, None][:, :0])
    return chosen, values, ids


def take_pending(ids: torch.Tensor, sources: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Input ids (T,) with every token whose ``sources`` entry is >= 0 taken from ``prev_tokens`` there:
    the tokens the step in flight sampled, which feed the next step without visiting the host."""
    return torch.where(sources >= 0, prev_tokens[sources.clamp(min=0)], ids)

"""Batched sampling: logits processing (logit bias, the min-tokens mask, repetition / frequency / presence
penalties), temperature, top-k, top-p, min-p, greedy, logprobs — one pass for the whole batch.

Randomness is counter-based: the noise for request r at output index i is a hash of (seed_r, i, token),
so a request's samples depend on its own seed only, never on what else shares the batch or on how
steps were cut (reproducible per request, and no per-request generator loop on the hot path).

Non-finite logits are reported, not sampled from: a row whose maximum is NaN, +inf or -inf (every logit -inf)
gets ``NONFINITE`` in the tokens the host reads (``report``). For greedy rows the chosen logit is that maximum
(``torch.argmax`` takes NaN as the largest value), so checking the one chosen value per row is enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.layers.ops import fused_ref

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


NONFINITE = fused_ref.NONFINITE
"""The token the host reads for a row whose logits were not finite (the device keeps a valid id there, so a
step already queued behind it runs on; the engine fails that request when it reads this)."""


def report(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """(B,) int64 tokens with ``NONFINITE`` where ``finite`` (B,) bool is False: what the host reads."""
    return torch.where(finite, tokens, NONFINITE)


def row_max_finite(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) bool: whether each row's maximum is finite (amax propagates NaN)."""
    return torch.isfinite(logits.amax(-1))


def chosen_finite(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, V), (B,) argmax tokens -> (B,) bool: whether the chosen logit (the row's maximum) is finite."""
    return torch.isfinite(logits.gather(-1, tokens[:, None]).squeeze(-1))


@dataclass(frozen=True, kw_only=True)
class LogitsProcessing:
    """Per-row logits processing for the P rows of a step that need it, as device tensors (vLLM's order:
    logit bias and the min-tokens mask, then the penalties). Rows without some part carry neutral values
    (bias 0, mask inactive, penalties 0 / 0 / 1 with an empty history)."""

    bias_ids: torch.Tensor | None       # (P, K) int64 token ids (padding: any id with bias 0)
    bias_values: torch.Tensor | None    # (P, K) float32
    masked_ids: torch.Tensor | None     # (P, M) int64: EOS and stop token ids (padding repeats an id)
    mask_active: torch.Tensor | None    # (P,) bool: fewer outputs than min_tokens, so the ids above are -inf
    history: torch.Tensor | None        # (P, L) int64: prompt then output token ids, padded (None: no penalties)
    num_prompt: torch.Tensor | None     # (P,) int64
    num_tokens: torch.Tensor | None     # (P,) int64 valid history entries (0 for rows without penalties)
    presence: torch.Tensor | None       # (P,) float32
    frequency: torch.Tensor | None      # (P,) float32
    repetition: torch.Tensor | None     # (P,) float32


def process_logits(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """(P, V) fp32 raw logits -> a processed copy. Penalties scatter each row's history into (P, V) counts:
    O(P x (V + L)) for the P rows that use them, nothing for the others."""
    x = logits.clone()
    if proc.bias_ids is not None:
        assert proc.bias_values is not None
        x.scatter_add_(1, proc.bias_ids, proc.bias_values)
    if proc.masked_ids is not None:
        assert proc.mask_active is not None
        kept = x.gather(1, proc.masked_ids)
        x.scatter_(1, proc.masked_ids, torch.where(proc.mask_active[:, None], float("-inf"), kept))
    if proc.history is not None:
        x = apply_penalties(x, proc)
    return x


def apply_penalties(x: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """Repetition (prompt and outputs), then frequency and presence (outputs) penalties, as vLLM applies
    them; history entries past ``num_tokens`` are ignored."""
    assert proc.history is not None and proc.num_prompt is not None and proc.num_tokens is not None
    assert proc.presence is not None and proc.frequency is not None and proc.repetition is not None
    rows, vocab = x.shape
    pos = torch.arange(proc.history.shape[1], device=x.device)[None, :]
    valid = pos < proc.num_tokens[:, None]
    spare = torch.full_like(proc.history, vocab)          # invalid entries land in a column cut off below
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=x.device)
    seen.scatter_(1, torch.where(valid, proc.history, spare), True)
    rep = proc.repetition[:, None]
    x = torch.where(seen[:, :vocab], torch.where(x > 0, x / rep, x * rep), x)
    output = valid & (pos >= proc.num_prompt[:, None])
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=x.device)
    counts.scatter_add_(1, torch.where(output, proc.history, spare), output.to(torch.float32))
    counts = counts[:, :vocab]
    return x - proc.frequency[:, None] * counts - proc.presence[:, None] * (counts > 0).to(torch.float32)


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

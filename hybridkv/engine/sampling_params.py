"""Sampling parameters, validated on construction (the names and meanings users know from vLLM).

Types are checked, not coerced: an integer field takes an ``int`` (numpy integers too), never a float
(``max_tokens=2.5``) or a bool; a real field takes an int or a float, finite, never a bool. What depends on
the model (token ids below the vocabulary size, logprob counts up to the engine's ``max_logprobs``, a
tokenizer for stop strings) is checked when the request is submitted (``LLMEngine.add_request``).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_LOGIT_BIAS = 100.0
"""Biases are clamped to [-100, 100], as the OpenAI API and vLLM do."""

SEED_RANGE = 1 << 63
"""Effective seeds are in [0, 2**63) (they live in int64 tensors)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _hash_to_seed(*parts: int) -> int:
    digest = hashlib.blake2b(b":".join(str(int(p)).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def effective_seed(seed: int) -> int:
    """A user seed as the sampler uses it: itself when in [0, 2**63), else hashed (blake2b) into that range
    (so any Python int is a valid, reproducible seed)."""
    return int(seed) if 0 <= seed < SEED_RANGE else _hash_to_seed(seed)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request with ``n`` samples: sample 0 keeps ``seed`` (so ``n=1`` is the
    first of ``n=k``), sample i > 0 hashes ``(seed, i)``. Offsets (``seed + i``, vLLM's rule) make sample 1 of
    seed 7 the same sequence as sample 0 of seed 8; a hash makes samples of different seeds unrelated."""
    return effective_seed(seed) if index == 0 else _hash_to_seed(seed, index)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """``temperature=0`` is greedy. ``seed`` makes a request's samples reproducible whatever else is in the
    batch. ``max_tokens=None`` generates up to the model's length. ``stop`` strings end generation (kept in the
    text only with ``include_stop_str_in_output``); ``stop_token_ids`` and EOS end it with the token. Until
    ``min_tokens`` outputs exist, EOS and ``stop_token_ids`` cannot be sampled and stop strings do not stop.
    ``logprobs=k`` returns the sampled token's log-probability and the top k (of the raw model distribution);
    ``prompt_logprobs=k`` the same for prompt tokens (what log-likelihood evaluations need).

    Logits processing, in vLLM's order, before temperature, top-k/p and min-p: ``logit_bias`` (token id ->
    bias added, clamped to [-100, 100]) and the ``min_tokens`` mask; then ``repetition_penalty`` (> 0; 1 = off:
    a logit of a token seen in the prompt or the outputs is divided by it when positive, multiplied when
    not), then ``frequency_penalty`` (times the token's count in the outputs) and ``presence_penalty`` (once if
    it occurs in the outputs) subtracted, both in [-2, 2]."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        errors = self._normalise()
        if errors:
            raise ValueError(f"SamplingParams: {'; '.join(errors)}")

    def _normalise(self) -> list[str]:
        """Check every field; convert the forms accepted for convenience (a list or a single string for
        ``stop``, numpy integers, digit-string keys of ``logit_bias`` as JSON sends them). Returns the errors."""
        errors: list[str] = []
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)

        def integer(name: str, low: int, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value):
                errors.append(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
            elif value < low:
                errors.append(f"{name} must be >= {low}, got {value}")
            else:
                put(name, int(value))

        def real(name: str, ok: Any, rule: str) -> None:
            value = getattr(self, name)
            if not _is_real(value):
                errors.append(f"{name} must be a finite number, got {value!r}")
            elif not ok(value):
                errors.append(f"{name} must be {rule}, got {value}")
            else:
                put(name, float(value))

        def flag(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be a bool, got {getattr(self, name)!r}")

        integer("n", 1)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        if self.seed is not None:
            if _is_int(self.seed):
                put("seed", int(self.seed))
            else:
                errors.append(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 0):
            errors.append(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        else:
            put("top_k", int(self.top_k))
        real("temperature", lambda v: v >= 0, ">= 0")
        real("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        real("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        real("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        real("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        real("repetition_penalty", lambda v: v > 0, "> 0")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            flag(name)
        if (isinstance(self.max_tokens, int) and isinstance(self.min_tokens, int)
                and self.min_tokens > self.max_tokens):
            errors.append(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        try:
            stop = tuple(stop)
        except TypeError:
            errors.append(f"stop must be a string or a sequence of strings, got {self.stop!r}")
            stop = ()
        if not all(isinstance(s, str) and s for s in stop):
            errors.append(f"stop strings must be non-empty strings, got {stop!r}")
        put("stop", stop)

        try:
            stop_ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        except TypeError:
            stop_ids = (self.stop_token_ids,)
        if not all(_is_int(t) and t >= 0 for t in stop_ids):
            errors.append(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        else:
            put("stop_token_ids", tuple(int(t) for t in stop_ids))

        bias = self.logit_bias if self.logit_bias is not None else {}
        if not isinstance(bias, Mapping):
            errors.append(f"logit_bias must be a mapping token id -> bias, got {type(bias).__name__}")
        else:
            clean: dict[int, float] = {}
            for key, value in bias.items():
                token = int(key) if isinstance(key, str) and key.isdigit() else key
                if not _is_int(token) or token < 0:
                    errors.append(f"logit_bias keys must be non-negative token ids, got {key!r}")
                elif not _is_real(value):
                    errors.append(f"logit_bias values must be finite numbers, got {value!r} for {key!r}")
                else:
                    clean[int(token)] = min(max(float(value), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
            put("logit_bias", clean)
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

"""``EngineLimits``: what a request is checked against -- the one copy of the engine's request checks.

``LLMEngine`` checks every request it takes with its own (``engine.limits``). The API process of ``hybridkv
serve`` holds no engine (the engine process does: ``engine/core.py``), yet must refuse a request it cannot serve
before answering (a 400, not a failed stream): the engine process sends its limits when it starts, and the API
process checks with them (the KV capacity check as a token bound: ``blocks_to_admit`` grows with the length).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine


class RequestError(ValueError):
    """A request that cannot be served (empty, too long, bad token ids); other requests are unaffected."""




@dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """``max_request_tokens``: the longest request (prompt and output) whose blocks the KV cache can hold at
    all; ``decode_skips``: the tokenizer's decode takes ``skip_special_tokens``."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_request_tokens: int
    has_tokenizer: bool
    decode_skips: bool
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "max_request_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineLimits: {name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"EngineLimits: max_logprobs must be an int >= 0, got {self.max_logprobs!r}")

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLimits:
        limit = engine.plan.max_model_len
        fits = limit
        if engine.plan.attention_groups:
            capacity, admit = engine._capacity_blocks, engine.coordinator.blocks_to_admit
            lo, hi = 0, limit                 # the largest length in [0, limit] that fits (monotone in length)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if admit(mid) <= capacity else (lo, mid - 1)
            fits = max(lo, 1)
        return cls(vocab_size=engine.vocab_size, max_model_len=limit, max_logprobs=engine.max_logprobs,
                   max_request_tokens=fits, has_tokenizer=engine.tokenizer is not None,
                   decode_skips=takes_skip_special_tokens(engine.tokenizer),
                   eos_token_ids=tuple(sorted(engine.eos_token_ids)))

    def check_request(self, token_ids: object, params: object) -> tuple[list[int], SamplingParams]:
        """The prompt as a list of ints and the params as the engine runs them (``max_tokens`` resolved), or
        ``RequestError`` with the first reason the engine refuses this request (one sample: n=1)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        vocab, limit = self.vocab_size, self.max_model_len
        ids = token_list(token_ids, vocab)
        n = len(ids)
        if n > limit:
            raise RequestError(f"prompt has {n} tokens, more than max_model_len={limit}")
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            raise RequestError(f"token ids must be integers in [0, {vocab}), got min {low} max {high}")
        if params.n != 1:
            raise RequestError(f"LLMEngine takes one sequence per request (n={params.n}); LLM splits n samples")
        for what, values in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in values if t >= vocab]
            if bad:
                raise RequestError(f"{what} has token ids {bad[:4]} outside the vocabulary [0, {vocab})")
        for what, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and k > self.max_logprobs:
                raise RequestError(f"{what}={k} is more than max_logprobs={self.max_logprobs} (an engine option)")
        if params.stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if not params.skip_special_tokens and self.has_tokenizer and not self.decode_skips:
            raise RequestError("skip_special_tokens=False: this tokenizer's decode takes no skip_special_tokens")
        max_tokens = max(limit - n, 1) if params.max_tokens is None else params.max_tokens
        final = min(n + max_tokens, limit)
        if final > self.max_request_tokens:
            raise RequestError(f"a {final}-token request needs more blocks than the KV cache holds (at most "
                               f"{self.max_request_tokens} tokens fit): raise kv_cache_memory")
        if params.max_tokens is None:
            params = replace(params, max_tokens=max_tokens)
        return ids, params


def takes_skip_special_tokens(tokenizer: object | None) -> bool:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return False
    try:
        parameters = inspect.signature(decode).parameters
    except (TypeError, ValueError):
        return True                 # a builtin without a signature: assume the common keyword
    return "skip_special_tokens" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def token_list(token_ids: object, vocab_size: int) -> list[int]:
    """A prompt's token ids as Python ints, or ``RequestError``: a sequence (or 1-D integer array) of ints
    (not bools, not floats), not empty (the caller checks their range)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise RequestError(f"token ids must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}")
        ids = token_ids.tolist()
    elif isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise RequestError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    else:
        ids = list(token_ids)
        if set(map(type, ids)) != {int}:                   # the common case: one C-speed pass, no Python loop
            for i, t in enumerate(ids):
                if not isinstance(t, numbers.Integral) or isinstance(t, bool | np.bool_):
                    raise RequestError(f"token ids must be integers in [0, {vocab_size}), got {t!r} at "
                                       f"position {i}")
            ids = [int(t) for t in ids]
    if not ids:
        raise RequestError("empty prompt")
    return ids


def decode_text(tokenizer: Any, ids: Sequence[int], params: SamplingParams, *, takes_skip: bool) -> str:
    """Text of ``ids``, special tokens skipped or kept as ``params`` asks (ours skip by default, transformers' keep:
    the keyword is passed whenever the tokenizer takes it, ``takes_skip_special_tokens``)."""
    if not takes_skip:
        return tokenizer.decode(list(ids))
    return tokenizer.decode(list(ids), skip_special_tokens=params.skip_special_tokens)

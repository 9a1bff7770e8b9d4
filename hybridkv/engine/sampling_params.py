"""Sampling parameters, validated on construction (the names and meanings users know from vLLM)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """``temperature=0`` is greedy. ``seed`` makes a request's samples reproducible whatever else is in
    the batch. ``stop`` strings end generation and are not included in the text. ``logprobs=k`` returns
    the sampled token's log-probability and the top k; ``prompt_logprobs=k`` the same for prompt tokens
    (what log-likelihood evaluations need)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string where a tuple is meant (frozen: set through object.__setattr__).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k must be -1, 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.n >= 1, "n must be >= 1"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.seed is None or self.seed >= 0, "seed must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message} (got {self})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""A request's life in the engine, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridkv.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1
"""Stands in ``Request.token_ids`` for a sampled token still on its way from the device (asynchronous
scheduling); never hashed, decoded or returned: the engine replaces it before any of those can see it."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()    # (token id, logprob), best first


@dataclass(frozen=True, kw_only=True)
class CompletionOutput:
    index: int
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None                   # "stop" | "length" | "abort" | None while running
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None   # None for the first prompt token
    error: str | None = None                    # a rejected request: why (other requests are unaffected)


@dataclass(kw_only=True, eq=False)
class Request:
    """Mutable engine-side state of one sequence (one of a prompt's ``n`` samples); compared by identity."""

    request_id: str
    token_ids: list[int]                        # prompt + outputs, appended in place (the coordinator
    num_prompt_tokens: int                      # hashes blocks from this very list)
    params: SamplingParams
    seed: int                                   # effective seed (params.seed or drawn by the engine)
    arrival: int                                # monotonically increasing: preemption takes the latest
    prompt: str | None = None
    kv_row: int = -1                            # the coordinator row while running (stable until freed);
                                                # its computed-token count lives in the coordinator
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_preemptions: int = 0
    num_pending: int = 0                        # trailing PENDING_TOKENs: sampled, not yet on the host

    def __post_init__(self) -> None:
        # Every streamed output carries the prompt: one tuple made once, not a copy per step.
        self._prompt = tuple(self.token_ids[:self.num_prompt_tokens])

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._prompt

    @property
    def output_token_ids(self) -> list[int]:
        """The outputs known on the host (pending tokens excluded)."""
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler counts, pending ones included."""
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    def drop_pending(self) -> None:
        """Forget tokens still on their way (the request finished or was aborted before they arrived)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

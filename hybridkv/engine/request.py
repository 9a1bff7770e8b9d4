"""A request's life in the engine, and what the user gets back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hybridkv.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1
"""Stands in ``Request.token_ids`` for a sampled token still on its way from the device (asynchronous
scheduling); never hashed, decoded or returned: the engine replaces it before any of those can see it."""


class OutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step`` builds for a request (vLLM's ``RequestOutputKind``, with one change).

    FINAL: one output, when it finishes. CUMULATIVE: after every step it advances, everything so far (the text
    decoded again each time). DELTA: after every step that gives it tokens, only those tokens and their logprobs
    (``text`` None: the caller detokenizes incrementally, as ``AsyncLLM`` does); the final output is cumulative,
    with the text (cut at a stop string) and the prompt logprobs."""

    FINAL = "final"
    CUMULATIVE = "cumulative"
    DELTA = "delta"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()    # (token id, logprob), best first


# The outputs are plain (not frozen) dataclasses: the engine builds one per streamed request per step, and a
# frozen one's __init__ costs ~3x as much (each field through object.__setattr__).
@dataclass(kw_only=True, slots=True)
class CompletionOutput:
    index: int
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None                   # "stop" | "length" | "abort" | "error" | None while running
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_reason: int | str | None = None        # the stop token id or stop string that ended it (None: EOS)


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestMetrics:
    """When things happened to a request, in ``time.monotonic()`` seconds (differences are meaningful, not
    the values: vLLM's arrival time is wall-clock). None: not yet."""

    arrival_time: float                         # submitted
    first_scheduled_time: float | None          # first step that computed any of it
    first_token_time: float | None              # its first output token reached the host
    last_token_time: float | None
    finished_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None   # None for the first prompt token
    error: str | None = None                    # why it was rejected or failed (other requests are unaffected)
    metrics: RequestMetrics | None = None        # on outputs of finished requests and cumulative ones
    num_cached_tokens: int | None = None        # prompt tokens its first step found in the prefix cache


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
    output_kind: OutputKind = OutputKind.CUMULATIVE
    num_delivered: int = 0                      # DELTA: output tokens already in an output
    kv_row: int = -1                            # the coordinator row while running (stable until freed);
                                                # its computed-token count lives in the coordinator
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_preemptions: int = 0
    num_pending: int = 0                        # trailing PENDING_TOKENs: sampled, not yet on the host
    error: str | None = None                    # why it failed (finish_reason "error")
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None        # set when first scheduled
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

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

    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(arrival_time=self.arrival_time, first_scheduled_time=self.first_scheduled_time,
                              first_token_time=self.first_token_time, last_token_time=self.last_token_time,
                              finished_time=self.finished_time)

"""The stand-in model of ``server_overhead.py``: an ``LLM`` whose step runner sleeps instead of computing.

A module of its own so that the engine process of ``hybridkv serve`` (``EngineCoreClient(factory=...)``) can
import the factory by name: the stand-in then runs where the real model would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hybridkv import LLM, EngineConfig
from hybridkv.engine.model_runner import StepBatch, StepOutput
from hybridkv.kv_groups.plan import KVCachePlan


class SleepRunner:
    """A step runner standing in for the model: ``host_s`` of Python work holding the GIL (the host work of a
    GPU step that the engine's own bookkeeping does not model: launches, graph replay, copies), then
    ``step_s + token_s x tokens`` of sleep (the GIL released, as a host waiting on the GPU), then each output
    row's token, a function of its input token (never a special one)."""

    def __init__(self, plan: KVCachePlan, vocab: int, *, step_s: float, token_s: float, first: int,
                 host_s: float = 0.0) -> None:
        self.plan, self.vocab, self.step_s, self.token_s, self.first = plan, vocab, step_s, token_s, first
        self.host_s = host_s
        self.device = torch.device("cpu")
        self.steps = 0

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        pass

    def host_moves_available(self) -> int:
        return 1 << 30

    def execute(self, batch: StepBatch) -> StepOutput:
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        if self.step_s or self.token_s:     # (no sleep at all when none is asked: a syscall that may yield the CPU)
            time.sleep(self.step_s + self.token_s * len(batch.input_ids))
        self.steps += 1
        last = batch.input_ids[batch.logits_indices]
        span = self.vocab - self.first
        return StepOutput(logits=None, greedy=torch.from_numpy((last * 7919 + 13) % span + self.first))


def sleep_llm(model: Any, config: EngineConfig, *, step_s: float, token_s: float, host_s: float = 0.0,
              first: int = 16) -> LLM:
    """``LLM(model, config=config)`` with its runner replaced by a ``SleepRunner`` (an ``EngineCoreClient``
    factory, with the times bound by ``functools.partial``)."""
    torch.set_num_threads(1)                 # (nothing here computes; a pool would only spin against the server)
    llm = LLM(model, config=config)
    llm.engine.runner = SleepRunner(llm.engine.plan, llm.engine.vocab_size, step_s=step_s, token_s=token_s,
                                    first=first, host_s=host_s)
    return llm

"""Start-up warm-up: serve a few synthetic requests so every kernel specialization a step can need is built
before the first user request, not inside the serving loop (a Triton compile takes ~1 s; a step ~1-10 ms).

What varies from step to step is either not specialized on by the kernels (token and request counts,
per-step strides and metadata pointers: ``do_not_specialize``) or falls in a few classes that the scenarios
below reach: decode vs prefill batches, split-KV or not, the row-tile classes of the decode-size linears
(<= 16, 32, 64 rows: projections by tokens, the logits head by sampling rows), greedy heads (argmax in the
epilogue) vs sampled ones (logits written), chunked prefill with a long context. Decode batches that CUDA
graphs replay were built when the graphs were captured.

The warm-up leaves the engine as it found it: no requests, counters and prefix-cache statistics reset, and
the engine's own seed stream untouched (every warm-up request has an explicit seed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine

logger = logging.getLogger("hybridkv.engine")

_ROW_CLASSES = (16, 32, 64, 128)     # the linears' row tiles (<= 64 on the Triton path), then cuBLAS
_PREFIX = "__warmup__"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Prompts of these lengths submitted together (admitted in this order), ``max_tokens`` new each."""

    prompt_lens: tuple[int, ...]
    max_tokens: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)


def scenarios(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[Scenario]:
    """The synthetic batches: one request of each row class of tokens (prefill projections), k requests of
    two-token prompts for each row class of sampling rows (the logits head, then decodes of k requests), and
    a short chunk over a long context (split-KV prefill): a prompt ``a`` then one of ``b`` tokens with
    a + b = budget + r, so the step computes ``a`` and all but r of ``b``, and the next step those r."""
    budget, longest = max_num_batched_tokens, max_model_len - 4       # room for the new tokens
    out: list[Scenario] = []
    for p in _ROW_CLASSES:
        if 2 <= p <= min(longest, budget):
            out.append(Scenario(prompt_lens=(p,), max_tokens=2))
    for k in sorted({8, 24, 48, 96, max_num_seqs}):
        if k <= max_num_seqs and 2 * k <= budget and longest >= 2:
            out.append(Scenario(prompt_lens=(2,) * k, max_tokens=3))
    r = min(24, budget // 2)
    b = min(longest, budget + r - 1)
    a = budget + r - b
    if r >= 2 and b > r and 1 <= a <= longest and max_num_seqs >= 2:
        out.append(Scenario(prompt_lens=(a, b), max_tokens=4))
    return out


def warm_up(engine: LLMEngine) -> float:
    """Run every scenario greedy, then sampled with prompt logprobs (logits of every prompt row), through
    ``engine``; returns the seconds it took. Must run before any user request is added."""
    if engine.has_unfinished:
        raise RuntimeError("warm_up: the engine already has requests")
    t0 = time.perf_counter()
    sched = engine.scheduler.config
    todo = scenarios(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                     max_model_len=sched.max_model_len)
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    n = 0
    for s in todo:
        for sampled in (False, True):
            params = SamplingParams(temperature=1.0 if sampled else 0.0, top_k=50 if sampled else 0,
                                    max_tokens=s.max_tokens, ignore_eos=True, seed=1,
                                    prompt_logprobs=0 if sampled and s.num_requests == 1 else None)
            for length in s.prompt_lens:
                engine.add_request(f"{_PREFIX}{n}", rng.integers(0, vocab, length).tolist(), params)
                n += 1
            while engine.has_unfinished:
                engine.step(only_finished=True)
    engine.reset_counters()
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d synthetic requests in %d batches, %.1f s", n, 2 * len(todo), seconds)
    return seconds

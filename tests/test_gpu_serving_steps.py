"""``benchmarks/gpu_serving_steps.py``'s summary: which intervals count, and how steps are grouped by prompt load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_intervals_skip_idle_gaps_and_group_by_the_prompt_here_or_in_flight() -> None:
    from gpu_serving_steps import Step, summarize

    def step(start: float, tokens: int, decodes: int, *, after_idle: bool = False) -> Step:
        return Step(start=start, tokens=tokens, decodes=decodes, host=0.001, wait=0.0005, after_idle=after_idle)

    steps = [step(0.000, 10, 10),           # decode only: 2 ms to the next
             step(0.002, 270, 10),          # a 260-token prompt: 3 ms
             step(0.005, 10, 10),           # decode, the prompt's step in flight: 1 ms
             step(0.006, 10, 10),           # decode: the engine then went idle
             step(1.000, 300, 0, after_idle=True),
             step(1.004, 5, 5)]
    out = summarize(steps)
    assert out["steps"] == 4                # the gap before the idle engine's next step is no inter-token wait
    assert out["interval_ms"]["p50"] == pytest.approx(2.5)          # of 2, 3, 1 and 4 ms
    assert set(out["groups"]) == {"0-0", "1-300"}
    assert out["groups"]["1-300"]["share"] == 0.75      # each prompt's step, and the one after the first (in flight)
    assert out["groups"]["1-300"]["interval_ms"]["mean"] == pytest.approx(8 / 3)
    assert out["groups"]["0-0"]["host_ms"] == pytest.approx(1.0)
    assert out["slowest"][0]["interval_ms"] == pytest.approx(4.0) and out["slowest"][0]["tokens"] == 300

"""Two compiled forms of a Triton kernel: one for CUDA-graph capture, one for eager steps.

A captured graph replays one launch forever, so its form is specialized on every argument (Triton's
divisibility-by-16, == 1 and pointer-alignment specializations) and compiled at capture. An eager step's row,
token, request and split counts change from step to step, and each new specialization would be a compile inside
the serving loop (~1 s against a 1-10 ms step); the eager form is not specialized on them, so one compile, made
by the start-up warm-up (``engine/warmup.py``), serves every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True, eq=False)
class KernelForms:
    graph: Any          # triton JITFunction, fully specialized
    eager: Any          # the same kernel, not specialized on per-step values

    def pick(self, t: torch.Tensor) -> Any:
        """The form for a launch on ``t``'s device now."""
        return self.graph if capturing(t) else self.eager


def two_forms(fn: Callable, *, per_step: Sequence[str], per_step_pointers: Sequence[str] = ()) -> KernelForms:
    """``fn`` jitted twice; ``per_step``: integer arguments that vary per step, ``per_step_pointers``: pointers to
    per-step metadata read one scalar at a time (their alignment buys no vectorization)."""
    return KernelForms(graph=triton.jit(fn),
                       eager=triton.jit(do_not_specialize=list(per_step),
                                        do_not_specialize_on_alignment=list(per_step_pointers))(fn))

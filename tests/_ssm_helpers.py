"""Shared hypothesis strategy for the state-space reference-kernel tests: packed batches of requests
with per-request state slots (new requests, continuations, 1-token, empty; shuffled and spare slots)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass
class Batch:
    lens: list[int]
    slots: list[int]
    has_init: list[bool]
    num_slots: int
    seed: int

    @property
    def qsl(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lens).cumsum(0).tolist()], dtype=torch.int32)


@st.composite
def packed_batches(draw: st.DrawFn, max_reqs: int = 4, max_len: int = 19) -> Batch:
    lens = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_reqs))
    num_slots = len(lens) + draw(st.integers(0, 3))
    slots = draw(st.permutations(range(num_slots)))[: len(lens)]
    has_init = draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    return Batch(lens, slots, has_init, num_slots, draw(st.integers(0, 2**31 - 1)))

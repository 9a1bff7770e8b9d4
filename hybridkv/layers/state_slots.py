"""The part every recurrent mixer shares: its per-request state lives in slots of the Mamba state pool (one
tensor per state of its ``MambaSpec``: conv + SSM state for Mamba, the conv state alone for a short conv),
bound once by the model runner, and each step it reads its group's ``MambaInputs`` and the kernel backend from
the forward context."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.backends.builders import MambaInputs
from hybridkv.backends.registry import KernelBackend
from hybridkv.forward_context import get_forward_context


class StateSlotMixer(nn.Module):
    def __init__(self, *, cache_name: str) -> None:
        super().__init__()
        self.cache_name = cache_name
        self.state: tuple[torch.Tensor, ...] | None = None   # bound by the model runner

    def bind_cache(self, *states: torch.Tensor) -> None:
        """One (num_slots, ...) tensor per state, in spec order: conv states (num_slots, conv channels,
        kernel - 1) first, then (Mamba) SSM states in fp32."""
        self.state = states

    def step_inputs(self) -> tuple[MambaInputs | KernelBackend | torch.Tensor, ...]:
        """This step's (inputs, backend, *states)."""
        if self.state is None:
            raise RuntimeError(f"{self.cache_name}: no state slots bound (the model runner binds them)")
        ctx = get_forward_context()
        return ctx.inputs[self.cache_name], ctx.backend, *self.state

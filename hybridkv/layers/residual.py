"""The residual add that ends a decoder branch, handed to the branch's output projection.

A branch (attention, Mamba, MLP) ends in a row-parallel output projection; the decoder layer then adds its
output to the residual stream with the branch's post-norm and the next pre-norm (``add_rms_norm``). A branch
with ``forward_add(..., add=ResidualAdd)`` runs its projection and that add as one backend op
(``linear_add_rms_norm``; on triton one kernel at decode sizes, so the add + norm costs no launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.forward_context import current_ops
from hybridkv.layers.linear import RowParallelLinear

__all__ = ["ResidualAdd"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResidualAdd:
    """``add_rms_norm``'s arguments other than the branch output: the stream, the norms, the multiplier."""

    residual: torch.Tensor                      # (num_tokens, hidden) the stream before the add
    weight: torch.Tensor | None                 # the next pre-norm; None: the new stream is not normed
    eps: float
    gemma: bool = False
    delta_weight: torch.Tensor | None = None    # the branch's post-norm (Gemma's sandwich norms)
    scale: float = 1.0                          # the residual multiplier

    def __call__(self, delta: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """delta: (num_tokens, hidden) a branch output -> (the next norm of the new stream or None, the stream)."""
        return current_ops().add_rms_norm(delta, self.residual, weight=self.weight, eps=self.eps, gemma=self.gemma,
                                          delta_weight=self.delta_weight, scale=self.scale)

    def project(self, x: torch.Tensor, linear: RowParallelLinear, *, multiplier: float = 1.0
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``self(multiplier * linear(x))``; one op when the projection is whole (no all-reduce between) and
        unscaled (a multiplier rounds between the projection and the add)."""
        if linear.tp.size > 1 or multiplier != 1.0:
            out = linear(x)
            return self(out * multiplier if multiplier != 1.0 else out)
        return current_ops().linear_add_rms_norm(x, linear.weight, linear.bias, self.residual, weight=self.weight,
                                                 eps=self.eps, gemma=self.gemma, delta_weight=self.delta_weight,
                                                 scale=self.scale)

"""Gemma-3n's alternating updates (AltUp) and learned augmented residual (Laurel), as HF's ``Gemma3nTextAltUp`` /
``Gemma3nTextLaurelBlock`` / ``Gemma3nTextModel`` compute them (weight names are HF's). All replicated under tensor
parallelism: their matrices are hidden x (streams or rank) or, for the model-level stream projections, hidden x
hidden."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.norms import RMSNorm
from hybridkv.models.config import AltUp as AltUpSpec


class AltUp(nn.Module):
    """One layer's predict / correct over the (streams, num_tokens, hidden) residual (see ``models.config.AltUp``).
    ``altup_coef_clip`` clamps the coefficient weights during training only; inference (HF's too) reads them as
    stored."""

    def __init__(self, hidden_size: int, spec: AltUpSpec, *, eps: float) -> None:
        super().__init__()
        n = spec.num_inputs
        self.num_inputs, self.active, self.correct_scale = n, spec.active_index, spec.correct_scale
        self.correct_output_scale = nn.Parameter(torch.ones(hidden_size))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden_size, n, bias=False)
        self.router_norm = RMSNorm(hidden_size, eps=eps)
        self.router_input_scale = hidden_size ** -1.0

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden) -> (num_tokens, streams), tanh in fp32
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """(streams, num_tokens, hidden) -> predictions of the same shape: ``x_j + sum_i c_ji x_i`` per token."""
        n = self.num_inputs
        coefs = self.prediction_coefs(self._modalities(streams[self.active])).view(-1, n, n)    # (tokens, j, i)
        # HF's matmul: (tokens, hidden, i) @ (tokens, i, j)
        mixed = torch.matmul(streams.permute(1, 2, 0), coefs.transpose(1, 2)).permute(2, 0, 1)
        return (mixed + streams).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """predictions (streams, num_tokens, hidden), activated: the layer's output (num_tokens, hidden) -> the
        corrected streams: ``p_j + (activated - p_active) * (1 + c_j)``."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0                  # (tokens, streams)
        innovation = activated - predictions[self.active]
        return (innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions).contiguous()

    def scale_corrected(self, x: torch.Tensor) -> torch.Tensor:
        """The corrected active stream as the per-layer input reads it: times ``correct_output_scale`` when
        ``correct_scale``."""
        if not self.correct_scale:
            return x
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class Laurel(nn.Module):
    """``x + norm(right(left(x)))``: a rank-``rank`` residual branch beside the mixer."""

    def __init__(self, hidden_size: int, rank: int, *, eps: float) -> None:
        super().__init__()
        self.linear_left = nn.Linear(hidden_size, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden_size, bias=False)
        self.post_laurel_norm = RMSNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to the per-token RMS ``target`` (its own RMS floored at sqrt(1e-5))."""
    magnitude = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


def expand_streams(x: torch.Tensor, projections: nn.ModuleList) -> torch.Tensor:
    """(num_tokens, hidden) embeddings -> (streams, num_tokens, hidden): x, then each projection of x at x's RMS."""
    target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([x] + [_rescaled(proj(x), target) for proj in projections])


def collapse_streams(streams: torch.Tensor, projections: nn.ModuleList) -> torch.Tensor:
    """(streams, num_tokens, hidden) -> (num_tokens, hidden): the mean of stream 0 and the other streams'
    unembedding projections at stream 0's RMS."""
    first = streams[0]
    target = torch.mean(first ** 2, dim=-1, keepdim=True) ** 0.5
    rest = [_rescaled(proj(s), target) for proj, s in zip(projections, streams[1:], strict=True)]
    return torch.mean(torch.stack([first, *rest]), dim=0)

"""RMS norms: the plain and Gemma ((1 + w) scaling) kinds, Cohere's bias-free LayerNorm (``centered``),
weightless RMS, and Mamba2's gated group norm. All compute in fp32 and return the input dtype, like the HF
references."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.ops.fused_ref import gated_rms_norm_ref, rms_norm_ref, rms_normalize
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel

__all__ = ["AcrossHeadsRMSNorm", "GatedGroupRMSNorm", "RMSNorm", "rms_normalize"]


class RMSNorm(nn.Module):
    """``gemma=True`` scales by (1 + w) with w initialised at 0, and casts after scaling, as Gemma does;
    ``centered=True`` subtracts the mean first (a LayerNorm without bias, Cohere) and casts after scaling."""

    def __init__(self, dim: int, *, eps: float = 1e-6, gemma: bool = False, centered: bool = False) -> None:
        super().__init__()
        if gemma and centered:
            raise ValueError("RMSNorm: gemma and centered are exclusive")
        self.eps = eps
        self.gemma = gemma
        self.centered = centered
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, eps=self.eps, gemma=self.gemma, centered=self.centered)


class AcrossHeadsRMSNorm(nn.Module):
    """One plain RMS norm over every head's channels of q or k (OLMo-2/3, OLMo-Hybrid ``q_norm`` / ``k_norm``:
    weight (heads * head_dim,)). ``heads``: the projection's ``Split``. Under tensor parallelism each rank holds
    its heads' channels and all-reduces the (tokens, 1) sum of squares; a head replicated on r ranks (kv heads
    fewer than ranks) is summed r times, and so is every channel once divided by tp * local width."""

    def __init__(self, heads: Split, *, eps: float, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.eps = eps
        self.tp = tp
        self.weight = nn.Parameter(torch.ones(heads.local_size(tp.size)))
        self.tp_shards = {"weight": Shard(0, (heads,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, local heads * head_dim)
        if self.tp.size == 1:
            return rms_norm_ref(x, self.weight, eps=self.eps)
        xf = x.float()
        mean_square = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / (self.tp.size * x.shape[-1])
        return self.weight * (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's output norm: ``norm(y * silu(z))`` computed per group of ``dim // n_groups`` channels;
    ``norm_before_gate``: ``norm(y) * silu(z)`` (Falcon-H1's ``mamba_norm_before_gate``), where the
    weight and the gate apply in fp32 before the cast, as HF does.

    ``dim`` and ``n_groups`` are the full sizes; under tensor parallelism each rank holds ``dim / tp``
    contiguous channels. When groups split evenly over the ranks every group is local; when a group spans
    several ranks (n_groups < tp, e.g. one group), its sum of squares is all-reduced (one (tokens, n_groups)
    fp32 all-reduce), so the norm is the same as unsharded."""

    def __init__(self, dim: int, *, n_groups: int, eps: float = 1e-5, norm_before_gate: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if dim % n_groups:
            raise ValueError(f"GatedGroupRMSNorm: n_groups={n_groups} must divide dim={dim}")
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.tp = tp
        split = Split(dim, dim, what="GatedGroupRMSNorm.dim")
        local_dim = split.local_size(tp.size)
        self.group_size = dim // n_groups
        self.spans_ranks = local_dim < self.group_size        # a group is cut across ranks
        if (tp.size % n_groups or self.group_size % local_dim) if self.spans_ranks else local_dim % self.group_size:
            raise ValueError(f"GatedGroupRMSNorm: n_groups={n_groups} must divide or be divisible by "
                             f"tensor_parallel_size={tp.size}")
        self.n_groups = 1 if self.spans_ranks else local_dim // self.group_size    # local groups
        self.full_groups = n_groups
        self.weight = nn.Parameter(torch.ones(local_dim))
        self.tp_shards = {"weight": Shard(0, (split,))}

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # y, z: (num_tokens, dim on this rank)
        if not self.spans_ranks:
            return gated_rms_norm_ref(y, z, self.weight, n_groups=self.n_groups, eps=self.eps,
                                      norm_before_gate=self.norm_before_gate)
        gate = nn.functional.silu(z.float())
        gated = y.float() if self.norm_before_gate else y.float() * gate
        normed = gated * torch.rsqrt(self._group_mean_square(gated) + self.eps)
        if self.norm_before_gate:
            return (self.weight.float() * normed * gate).to(y.dtype)
        return self.weight * normed.to(y.dtype)

    def _group_mean_square(self, gated: torch.Tensor) -> torch.Tensor:
        """(num_tokens, 1): mean square over this rank's group, summed over the ranks that share it."""
        sums = gated.new_zeros(*gated.shape[:-1], self.full_groups)
        group = self.tp.rank * self.full_groups // self.tp.size
        sums[..., group] = gated.pow(2).sum(-1)
        self.tp.all_reduce(sums)
        return (sums[..., group] / self.group_size).unsqueeze(-1)


class HeadNormWeight(nn.Module):
    """A per-head norm's weight (head_dim,), shared by every head (the delta-rule layers' gated output norms apply
    it); a module so the hub names ``norm.weight`` / ``o_norm.weight`` map one to one."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

"""Mixture of experts with the three routers hybridkv's families use.

- ``softmax``: top-k of softmax(logits), optionally renormalised (Jamba, Granite, Mixtral style).
- ``sigmoid_input``: Llama-4 — sigmoid of the top-k logits scales each expert's *input*.
- ``sigmoid_bias``: NemotronH — sigmoid scores; a learned correction bias steers selection only (first
  keeping the ``topk_groups`` best expert groups); weights renormalised and scaled by
  ``routed_scaling_factor``. With ``latent_size`` the routed experts run between ``fc1_latent_proj`` and
  ``fc2_latent_proj``; the shared expert always sees the layer input.

Experts are stored stacked, (num_experts, out, in), so one gather feeds any grouped-GEMM kernel later;
the reference loop runs over experts (a handful), never over tokens or requests.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.activations import get_activation
from hybridkv.layers.mlp import DenseMLP
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel
from hybridkv.models.config import MoE


class MoEFeedForward(nn.Module):
    """Tensor parallel inside the experts: every rank holds every expert, with 1/tp of its intermediate
    channels (gate/up rows, down columns), and the shared expert likewise. Routing is replicated (the router
    is tiny), so each rank picks the same experts for the same tokens with no all-to-all and no load
    imbalance between ranks; routed and shared partial sums are all-reduced once at the end."""

    def __init__(self, hidden_size: int, cfg: MoE, *, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.act = get_activation(cfg.activation)
        e = cfg.num_experts
        channels = (Split(cfg.intermediate_size, cfg.intermediate_size, what="MoE.intermediate_size"),)
        inter = channels[0].local_size(tp.size)
        dim = cfg.latent_size or hidden_size           # routed experts run in the latent space if any
        self.router = nn.Linear(hidden_size, e, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(e, inter, dim)) if cfg.gated else None
        self.up_proj = nn.Parameter(torch.empty(e, inter, dim))
        self.down_proj = nn.Parameter(torch.empty(e, dim, inter))
        self.fc1_latent_proj = nn.Linear(hidden_size, dim, bias=False) if cfg.latent_size else None
        self.fc2_latent_proj = nn.Linear(dim, hidden_size, bias=False) if cfg.latent_size else None
        self.correction_bias = (nn.Parameter(torch.zeros(e), requires_grad=False)
                                if cfg.router == "sigmoid_bias" else None)
        self.shared = (DenseMLP(hidden_size, cfg.shared_intermediate_size, activation=cfg.activation,
                                gated=cfg.gated, tp=tp, reduce=False) if cfg.shared_intermediate_size else None)
        self.tp_shards = {"gate_proj": Shard(1, channels), "up_proj": Shard(1, channels),
                          "down_proj": Shard(2, channels)}
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids, weights), both (num_tokens, top_k)."""
        logits = self.router(x).float()
        k = self.cfg.top_k
        if self.cfg.router == "softmax":
            weights, ids = logits.softmax(-1).topk(k, dim=-1)
            if self.cfg.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        elif self.cfg.router == "sigmoid_input":
            top, ids = logits.topk(k, dim=-1)
            weights = top.sigmoid()
        else:
            scores = logits.sigmoid()
            choice = scores + self.correction_bias.float()
            if self.cfg.topk_groups < self.cfg.num_groups:
                # Keep the topk_groups groups whose two best corrected scores sum highest.
                grouped = choice.view(choice.shape[0], self.cfg.num_groups, -1)
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
                keep = group_scores.topk(self.cfg.topk_groups, dim=-1).indices
                mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
                choice = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(1)
            ids = choice.topk(k, dim=-1).indices
            weights = scores.gather(-1, ids)
            if self.cfg.renormalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.cfg.routed_scaling_factor

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        up = x @ self.up_proj[e].t()
        h = self.act(x @ self.gate_proj[e].t()) * up if self.gate_proj is not None else self.act(up)
        return h @ self.down_proj[e].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        ids, weights = self.route(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        out = torch.zeros_like(h, dtype=torch.float32)
        scale_input = self.cfg.router == "sigmoid_input"
        for e in range(self.cfg.num_experts):
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            if token.numel() == 0:
                continue
            w = weights[token, slot, None]
            if scale_input:
                y = self._expert(e, (h[token].float() * w).to(h.dtype)).float()
            else:
                y = self._expert(e, h[token]).float() * w
            out.index_add_(0, token, y)
        out = out.to(x.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)      # linear, so it may run on this rank's partial sum
        if self.shared is not None:
            out = out + self.shared(x)
        return self.tp.all_reduce(out)

"""Mixture of experts with the four routers hybridkv's families use, and Gemma-4's dense MLP + experts block
(``DenseMoEFeedForward``).

- ``softmax``: top-k of softmax(logits), optionally renormalised (Jamba, Granite, Mixtral style).
- ``topk_softmax``: gpt-oss — softmax over the top-k logits (of a router with a bias); its experts have
  biases and the clamped SwiGLU ``swiglu_oai`` (``layers/activations.py``).
- ``sigmoid_input``: Llama-4 — sigmoid of the top-k logits scales each expert's *input*.
- ``sigmoid_bias``: NemotronH — sigmoid scores; a learned correction bias steers selection only (first
  keeping the ``topk_groups`` best expert groups); weights renormalised and scaled by
  ``routed_scaling_factor``. With ``latent_size`` the routed experts run between ``fc1_latent_proj`` and
  ``fc2_latent_proj``; the shared expert always sees the layer input.

Experts are stored stacked, (num_experts, out, in). Five implementations of the routed experts compute
the same function (``run_experts``); ``auto`` picks one per call (``choose_impl``) and every one of them is
what ``auto`` runs somewhere:

- ``ref`` (``moe_experts_ref``): a loop over experts with ``nonzero`` — the reference twin, and the CPU
  default. On a GPU each ``nonzero`` is a device->host sync (one per expert per layer), so it is slow and
  cannot be captured in a CUDA graph.
- ``grouped`` (``moe_experts_grouped``): sort the (token, slot) assignments by expert, gather the inputs,
  per-expert row offsets on the device (``searchsorted`` of the sorted ids), three ``torch._grouped_mm``
  calls, then one kernel that reads each token's slots out of the expert-sorted rows, weights, sums and rounds
  them and adds the shared expert (``moe_combine``; ``moe_combine_ref`` on the CPU). No host sync, shapes
  fixed by the number of tokens: CUDA-graph capturable. Reads only the weights of experts that got tokens.
  The CUDA default for bf16 on sm90/sm100, where torch has a CUTLASS grouped GEMM; for other dtypes or
  GPUs torch's ``_grouped_mm`` falls back to a per-group loop that copies the offsets to the host (a sync),
  so it is not chosen there. It also runs on the CPU (torch's fallback), where tests check it.
- ``padded`` (``moe_experts_padded``): every expert gets a (num_tokens, dim) batch whose row t is token t's
  input when t chose the expert and zero otherwise; one ``bmm`` per projection over (E, num_tokens, ·),
  then each (token, slot) reads its expert's row t. No sort, no sync, static shapes, any dtype — but E x
  the FLOPs and it reads every expert's weights: the GPU path above the Triton kernels' sizes where the grouped
  GEMM is not fast (other dtypes or GPUs), while num_experts x num_tokens <= ``PADDED_MAX_ROWS``; larger
  batches there use ``ref``.
- ``gemv`` (``backends/triton_moe.py``): two Triton GEMV kernels, one program row per (token, slot) reading
  only its expert's weights at memory bandwidth. The CUDA default for decode-size batches (at most
  ``GEMV_MAX_ROWS`` assignments), where a grouped GEMM is dominated by its tile setup.
- ``tiled`` (``backends/triton_moe.py``): two Triton kernels, one program per (expert, output block) that
  picks its expert's assignments out of all of them in registers: each active expert's weights read once,
  and no sort, gather or scatter around them. The CUDA default for mid-size batches (at most
  ``TILED_MAX_ROWS`` assignments), where those would cost as much as the grouped GEMM.

``MoEFeedForward(impl=...)`` fixes one instead of ``auto`` (the tests run every path on the CPU this way);
the choice is logged once per (device, dtype, impl).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.forward_context import current_ops
from hybridkv.layers.activations import get_activation, swiglu_oai
from hybridkv.layers.linear import PackedLinears
from hybridkv.layers.mlp import DenseMLP
from hybridkv.layers.norms import RMSNorm
from hybridkv.layers.ops.fused_ref import gated_addend, moe_combine_ref, rms_normalize
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel
from hybridkv.models.config import MoE

logger = logging.getLogger("hybridkv.moe")

MOE_IMPLS = ("auto", "ref", "grouped", "padded", "gemv", "tiled")
PADDED_MAX_ROWS = 8192        # auto picks "padded" only while num_experts * num_tokens <= this
GEMV_MAX_ROWS = 8             # auto picks "gemv" on CUDA while num_tokens * top_k <= this
TILED_MAX_ROWS = 512          # ... and "tiled" while num_tokens * top_k <= this (one launch per projection)
_logged: set[tuple[str, torch.dtype, str]] = set()


@dataclass(frozen=True, kw_only=True)
class Experts:
    """One layer's routed experts (this rank's channels): ``up``/``gate`` (E, inter, dim), ``down``
    (E, dim, inter); ``scale_input``: the routing weight scales the expert input (Llama-4), not its output.
    Biases (gpt-oss): ``gate_bias`` / ``up_bias`` (E, inter), ``down_bias`` (E, dim), added after each
    projection in the model dtype, as HF does. ``alpha`` / ``limit``: ``swiglu_oai``'s constants."""

    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    activation: str
    scale_input: bool
    gate_up: torch.Tensor | None = None      # (E, 2 * inter, dim) whose halves ``gate`` and ``up`` are views of
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None  # (E, 2 * inter), packed with ``gate_up``
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def num_experts(self) -> int:
        return self.up.shape[0]

    def one(self, e: int) -> Experts:
        """Expert ``e`` alone (its weights and biases with the expert dim indexed away)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[e] if t is not None else None

        return Experts(gate=pick(self.gate), up=self.up[e], down=self.down[e], activation=self.activation,
                       scale_input=self.scale_input, gate_bias=pick(self.gate_bias), up_bias=pick(self.up_bias),
                       down_bias=pick(self.down_bias), alpha=self.alpha, limit=self.limit)

    def mlp(self, x: torch.Tensor, proj: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            bias: Callable[[torch.Tensor], torch.Tensor] = lambda b: b) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) (or down(act(up(x))) when not gated) with ``proj(x, W)`` = x @ W^T
        for whichever batching the caller uses, and ``bias(b)``: an (E, out) bias (or (out,) for ``one``) as
        ``proj``'s output rows need it."""
        def plus(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return y if b is None else y + bias(b)

        if self.activation == "swiglu_oai":
            if self.gate_up is not None:
                gate, up = plus(proj(x, self.gate_up), self.gate_up_bias).chunk(2, dim=-1)
            else:
                gate, up = plus(proj(x, self.gate), self.gate_bias), plus(proj(x, self.up), self.up_bias)
            return plus(proj(swiglu_oai(gate, up, alpha=self.alpha, limit=self.limit), self.down), self.down_bias)
        if self.gate_up is not None:              # one projection for both, then the fused act x up
            gate_up = plus(proj(x, self.gate_up), self.gate_up_bias)   # (rows, 2 * inter), or (E, rows, 2 * inter)
            h = current_ops().act_mul(gate_up.reshape(-1, gate_up.shape[-1]), activation=self.activation)
            return plus(proj(h.view(*gate_up.shape[:-1], -1), self.down), self.down_bias)
        act = get_activation(self.activation)
        up = plus(proj(x, self.up), self.up_bias)
        h = act(plus(proj(x, self.gate), self.gate_bias)) * up if self.gate is not None else act(up)
        return plus(proj(h, self.down), self.down_bias)


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x * w in fp32, rounded back to x's dtype (HF Llama-4 scales the expert input this way). The product
    of x and an fp32 w promotes to fp32 in one kernel (no fp32 copy of x first): the same values."""
    return torch.mul(x, w.float()).to(x.dtype)


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Reference: loop over experts. x (T, dim); ids, weights (T, k) -> fp32 (T, dim)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(experts.num_experts):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        w = weights[token, slot, None]
        one = experts.one(e)
        if experts.scale_input:
            y = one.mlp(_scaled(x[token], w), lambda a, wt: a @ wt.t()).float()
        else:
            y = one.mlp(x[token], lambda a, wt: a @ wt.t()).float() * w
        out.index_add_(0, token, y)
    return out


def moe_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, *,
                        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Sort by expert + grouped GEMM; no host sync. x (T, dim); ids, weights (T, k) -> (T, dim) in x's dtype, plus
    the (gated) ``addend`` (``run_experts``): the slots weighted (unless the input was scaled), summed in fp32 and
    rounded once, straight from the expert-sorted rows (``moe_combine``: one Triton launch on CUDA)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)                                                       # (T*k,) slot-major per token
    sorted_ids, order = torch.sort(flat, stable=True)                            # (T*k,)
    bounds = torch.arange(experts.num_experts, device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)    # (E,) end row of each expert
    rows = x.index_select(0, order // k)                                         # (T*k, dim) grouped by expert
    if experts.scale_input:
        rows = _scaled(rows, weights.reshape(-1).index_select(0, order)[:, None])
    y = experts.mlp(rows, lambda a, wt: torch._grouped_mm(a, wt.transpose(-2, -1), offs=offs),
                    lambda b: b.index_select(0, sorted_ids))                     # (T*k, dim) in expert order
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    combine = moe_combine_ref
    if y.is_cuda:
        from hybridkv.backends.triton_moe import moe_combine as combine
    return combine(y, k=k, out_dtype=x.dtype, positions=positions,
                   weights=None if experts.scale_input else weights, addend=addend, addend_gate=addend_gate)


def moe_experts_padded(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: Experts) -> torch.Tensor:
    """One zero-padded (num_tokens, dim) batch per expert + ``bmm``; no host sync, no sort. Row t of expert
    e is token t (the top-k ids of a token are distinct, so T rows per expert always suffice).
    x (T, dim); ids, weights (T, k) -> fp32 (T, dim)."""
    num_tokens, k = ids.shape
    token = torch.arange(num_tokens, device=ids.device)[:, None].expand(num_tokens, k)    # (T, k)
    w = weights[..., None]                                                                # (T, k, 1) fp32
    rows = _scaled(x[:, None], w) if experts.scale_input else x[:, None].expand(num_tokens, k, x.shape[-1])
    batch = x.new_zeros(experts.num_experts, num_tokens, x.shape[-1])                     # (E, T, dim)
    batch[ids, token] = rows
    y = experts.mlp(batch, lambda a, wt: torch.bmm(a, wt.transpose(-2, -1)), lambda b: b[:, None])   # (E, T, dim)
    y = y[ids, token].float()                                                             # (T, k, dim)
    if not experts.scale_input:
        y = y * w
    return y.sum(1)


def moe_experts_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, *,
                     addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Two Triton GEMV kernels, one program row per (token, slot) (``backends/triton_moe.py``) -> x's dtype,
    plus the (gated) ``addend`` (``run_experts``), both added in the down kernel."""
    from hybridkv.backends.triton_moe import moe_experts_gemv as gemv

    return gemv(x, ids, weights, **_kernel_experts(experts), addend=addend, addend_gate=addend_gate)


def moe_experts_tiled(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, *,
                      addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Two Triton kernels, one program per (expert, output block) over that expert's assignments
    (``backends/triton_moe.py``); ``moe_experts_gemv``'s contract."""
    from hybridkv.backends.triton_moe import moe_experts_tiled as tiled

    return tiled(x, ids, weights, **_kernel_experts(experts), addend=addend, addend_gate=addend_gate)


def _kernel_experts(experts: Experts) -> dict:
    """The Triton kernels' expert arguments (they read gate and up separately: no packed tensors)."""
    return dict(gate=experts.gate, up=experts.up, down=experts.down, activation=experts.activation,
                scale_input=experts.scale_input, gate_bias=experts.gate_bias, up_bias=experts.up_bias,
                down_bias=experts.down_bias, alpha=experts.alpha, limit=experts.limit)


_IMPLS = {"ref": moe_experts_ref, "grouped": moe_experts_grouped, "padded": moe_experts_padded,
          "gemv": moe_experts_gemv, "tiled": moe_experts_tiled}
_ADDS_IN_KERNEL = ("grouped", "gemv", "tiled")     # impls that take ``addend`` (the others add it after)


def grouped_mm_is_fast(device: torch.device) -> bool:
    """torch's CUTLASS grouped GEMM (no host sync) runs on sm90 / sm100 for bf16 only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_impl(impl: str, x: torch.Tensor, ids: torch.Tensor, experts: Experts) -> str:
    """Resolve "auto": the reference loop on the CPU (exact, and a sync costs nothing there); on CUDA the
    Triton GEMVs and tiles for decode- and mid-size batches, the grouped GEMM for bf16 on sm90/sm100 (dims
    16-byte aligned); else the padded bmm for decode-size batches (num_experts * num_tokens <=
    PADDED_MAX_ROWS) and the reference loop for larger ones."""
    if impl != "auto":
        return impl
    if x.device.type != "cuda":
        return "ref"
    if ids.numel() <= TILED_MAX_ROWS and _triton_available():
        return "gemv" if ids.numel() <= GEMV_MAX_ROWS else "tiled"
    inter, dim = experts.up.shape[1], experts.up.shape[2]
    if x.dtype == torch.bfloat16 and grouped_mm_is_fast(x.device) and inter % 8 == 0 and dim % 8 == 0:
        return "grouped"
    return "padded" if experts.num_experts * x.shape[0] <= PADDED_MAX_ROWS else "ref"


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, *,
                impl: str = "auto", addend: torch.Tensor | None = None,
                addend_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum: x (T, dim); ids (T, k) expert ids; weights (T, k) fp32 -> (T, dim) in
    x's dtype, summed in fp32 and rounded once, plus ``addend`` (T, dim) in x's dtype when given (``out +
    addend``, rounded again: the shared expert's output, which the Triton kernels add in their last store),
    first scaled by ``sigmoid(addend_gate)`` ((T, 1) logits, the shared expert's gate) when given.
    ``impl``: one of ``MOE_IMPLS``."""
    if x.shape[0] == 0:                      # no tokens: nothing to route (grouped GEMMs of zero rows are avoided)
        return x.new_zeros(x.shape)
    name = choose_impl(impl, x, ids, experts)
    key = (x.device.type, x.dtype, name)
    if key not in _logged:
        _logged.add(key)
        logger.info("MoE experts on %s %s: %s (asked: %s)", x.device.type, str(x.dtype).removeprefix("torch."),
                    name, impl)
    if name in _ADDS_IN_KERNEL:
        return _IMPLS[name](x, ids, weights, experts, addend=addend, addend_gate=addend_gate)
    out = _IMPLS[name](x, ids, weights, experts).to(x.dtype)
    return out if addend is None else out + gated_addend(addend, addend_gate)


def _check_impl(impl: str) -> str:
    if impl not in MOE_IMPLS:
        raise ValueError(f"MoE implementation {impl!r} is not one of {MOE_IMPLS}")
    return impl


class MoEFeedForward(nn.Module):
    """Tensor parallel inside the experts: every rank holds every expert, with 1/tp of its intermediate
    channels (gate/up rows, down columns), and the shared expert likewise. Routing is replicated (the router
    is tiny), so each rank picks the same experts for the same tokens with no all-to-all and no load
    imbalance between ranks; routed and shared partial sums are all-reduced once at the end.

    ``impl``: how the routed experts run (module docstring; default "auto"). A plain attribute, so a test may
    change it on a built layer.

    Expert biases (gpt-oss): gate/up biases split with their channels; the down bias is added after the
    row-parallel down projection's partial sums, so only rank 0 adds it (the all-reduce then sums it once)."""

    def __init__(self, hidden_size: int, cfg: MoE, *, tp: TensorParallel = SINGLE, impl: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.impl = _check_impl(impl)
        if cfg.activation != "swiglu_oai":
            get_activation(cfg.activation)      # fails early on an unknown name
        e = cfg.num_experts
        channels = (Split(cfg.intermediate_size, cfg.intermediate_size, what="MoE.intermediate_size"),)
        inter = channels[0].local_size(tp.size)
        dim = cfg.latent_size or hidden_size           # routed experts run in the latent space if any
        self.router = nn.Linear(hidden_size, e, bias=cfg.router_bias)
        self.gate_proj = nn.Parameter(torch.empty(e, inter, dim)) if cfg.gated else None
        self.up_proj = nn.Parameter(torch.empty(e, inter, dim))
        self.down_proj = nn.Parameter(torch.empty(e, dim, inter))
        self.gate_bias = nn.Parameter(torch.zeros(e, inter)) if cfg.bias and cfg.gated else None
        self.up_bias = nn.Parameter(torch.zeros(e, inter)) if cfg.bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, dim)) if cfg.bias else None
        self.fc1_latent_proj = nn.Linear(hidden_size, dim, bias=False) if cfg.latent_size else None
        self.fc2_latent_proj = nn.Linear(dim, hidden_size, bias=False) if cfg.latent_size else None
        self.correction_bias = (nn.Parameter(torch.zeros(e), requires_grad=False)
                                if cfg.router == "sigmoid_bias" else None)
        self.shared = (DenseMLP(hidden_size, cfg.shared_intermediate_size, activation=cfg.activation,
                                gated=cfg.gated, tp=tp, reduce=False) if cfg.shared_intermediate_size else None)
        # Replicated (one output): sigmoid(x . w) scales this rank's partial sum, so the all-reduce sums it right.
        self.shared_gate = nn.Linear(hidden_size, 1, bias=False) if cfg.shared_gate else None
        self.tp_shards = {"gate_proj": Shard(1, channels), "up_proj": Shard(1, channels),
                          "down_proj": Shard(2, channels), "gate_bias": Shard(1, channels),
                          "up_bias": Shard(1, channels)}
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            if p is not None:
                nn.init.normal_(p, std=0.02)
        self._gate_up: tuple[torch.Tensor, tuple[int, int]] | None = None    # (packed, its views' pointers)
        self.router_gate: PackedLinears | None = None      # router|shared gate as one GEMM (``fuse_projections``)
        self._gate_up_bias: tuple[torch.Tensor, tuple[int, int]] | None = None

    def fuse_projections(self) -> None:
        """Pack the routed experts' gate and up into one (E, 2 * inter, dim) tensor whose halves become the
        parameters (no extra memory, the same ``state_dict``): one grouped GEMM instead of two, and the
        fused act x up after it. The router and the shared expert's gate likewise: one GEMV at decode."""
        if (self.shared_gate is not None and not (self.router_gate is not None and self.router_gate.valid())
                and PackedLinears.can_pack(self.router, self.shared_gate)):
            self.router_gate = PackedLinears(self.router, self.shared_gate)
        if self.gate_proj is None or self._packed_gate_up() is not None:
            return
        if self.gate_proj.dtype != self.up_proj.dtype or self.gate_proj.device != self.up_proj.device:
            return
        inter = self.up_proj.shape[1]
        with torch.no_grad():
            packed = torch.cat([self.gate_proj, self.up_proj], dim=1)
            self.gate_proj = nn.Parameter(packed[:, :inter], requires_grad=self.gate_proj.requires_grad)
            self.up_proj = nn.Parameter(packed[:, inter:], requires_grad=self.up_proj.requires_grad)
        self._gate_up = (packed, (self.gate_proj.data_ptr(), self.up_proj.data_ptr()))
        if self.gate_bias is not None:
            with torch.no_grad():
                packed = torch.cat([self.gate_bias, self.up_bias], dim=1)
                self.gate_bias = nn.Parameter(packed[:, :inter], requires_grad=self.gate_bias.requires_grad)
                self.up_bias = nn.Parameter(packed[:, inter:], requires_grad=self.up_bias.requires_grad)
            self._gate_up_bias = (packed, (self.gate_bias.data_ptr(), self.up_bias.data_ptr()))

    def _packed_gate_up(self) -> torch.Tensor | None:
        """The packed gate|up while both parameters are still its views (a move or a replaced parameter
        breaks them: then the experts run unpacked), and its biases likewise (the two pack together)."""
        if self._gate_up is None or self.gate_proj is None:
            return None
        packed, ptrs = self._gate_up
        if (self.gate_proj.data_ptr(), self.up_proj.data_ptr()) != ptrs:
            return None
        if self.gate_bias is not None and self._packed_gate_up_bias() is None:
            return None
        return packed

    def _packed_gate_up_bias(self) -> torch.Tensor | None:
        if self._gate_up_bias is None or self.gate_bias is None:
            return None
        packed, ptrs = self._gate_up_bias
        return packed if (self.gate_bias.data_ptr(), self.up_bias.data_ptr()) == ptrs else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids, fp32 weights), both (num_tokens, top_k). No host sync."""
        return self._route(x)[:2]

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(expert ids, fp32 weights, the shared expert's gate logit (T, 1) or None): the router's projection and
        the routing as one op (one kernel at decode), the gate's row packed with the router's when it can be."""
        ops, cfg = current_ops(), self.cfg
        packed = self.router_gate is not None and self.router_gate.valid()
        weight, bias = (self.router_gate.weight, self.router_gate.bias) if packed else (self.router.weight,
                                                                                         self.router.bias)
        ids, weights, logits = ops.linear_moe_route(
            x, weight, bias, num_experts=cfg.num_experts, router=cfg.router, top_k=cfg.top_k,
            renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor, correction_bias=self.correction_bias,
            num_groups=cfg.num_groups, topk_groups=cfg.topk_groups)
        if self.shared_gate is None:
            return ids, weights, None
        gate = logits[:, cfg.num_experts:] if packed else ops.linear(x, self.shared_gate.weight, None)
        return ids, weights, gate

    def experts(self) -> Experts:
        gate_up = self._packed_gate_up()
        return Experts(gate=self.gate_proj, up=self.up_proj, down=self.down_proj, activation=self.cfg.activation,
                       scale_input=self.cfg.router == "sigmoid_input", gate_up=gate_up,
                       gate_bias=self.gate_bias, up_bias=self.up_bias,
                       down_bias=self.down_bias if self.tp.rank == 0 else None,
                       gate_up_bias=self._packed_gate_up_bias() if gate_up is not None else None,
                       alpha=self.cfg.swiglu_alpha, limit=self.cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        ids, weights, gate_logit = self._route(x)
        shared = self.shared(x) if self.shared is not None else None
        if self.fc1_latent_proj is None:       # the (gated) shared expert's output joins in the experts' last store
            return self.tp.all_reduce(run_experts(x, ids, weights, self.experts(), impl=self.impl, addend=shared,
                                                  addend_gate=gate_logit))
        out = run_experts(self.fc1_latent_proj(x), ids, weights, self.experts(), impl=self.impl)
        out = self.fc2_latent_proj(out)          # linear, so it may run on this rank's partial sum
        return self.tp.all_reduce(out if shared is None else out + gated_addend(shared, gate_logit))


class DenseMoEFeedForward(nn.Module):
    """Gemma-4's MoE block (``models.config.DenseMoE``): ``post_mlp_norm(mlp(n)) + post_moe_norm(experts(moe_norm(x)))``
    with the router on the layer input x (``rms(x) * router_scale * hidden^-0.5``, softmax top-k renormalised, times
    ``per_expert_scale``). Under tensor parallelism both branches are summed over the ranks before their post-norms."""

    def __init__(self, hidden_size: int, mlp: DenseMLP, cfg: MoE, *, norm_eps: float, gemma_norm: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.mlp = mlp
        self.moe = MoEFeedForward(hidden_size, cfg, tp=tp)       # its ``router`` is the router's projection
        self.post_mlp_norm = RMSNorm(hidden_size, eps=norm_eps, gemma=gemma_norm)
        self.moe_norm = RMSNorm(hidden_size, eps=norm_eps, gemma=gemma_norm)
        self.post_moe_norm = RMSNorm(hidden_size, eps=norm_eps, gemma=gemma_norm)
        self.router_scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.norm_eps = norm_eps
        self.tp = tp

    def forward(self, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # normed: the layer's ffn norm of x; x: the layer input (residual stream); both (num_tokens, hidden)
        ops, cfg = current_ops(), self.moe.cfg
        x = x.to(normed.dtype)
        dense = self.post_mlp_norm(self.mlp(normed))
        routed_in = rms_normalize(x, self.norm_eps).to(x.dtype) * self.router_scale * x.shape[-1] ** -0.5
        ids, weights, _ = ops.linear_moe_route(routed_in, self.moe.router.weight, None, num_experts=cfg.num_experts,
                                               router="softmax", top_k=cfg.top_k, renormalize=True)
        weights = weights * self.per_expert_scale[ids].float()
        routed = run_experts(self.moe_norm(x), ids, weights, self.moe.experts(), impl=self.moe.impl)
        return dense + self.post_moe_norm(self.tp.all_reduce(routed))

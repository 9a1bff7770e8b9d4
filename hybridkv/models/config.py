"""A decoder described as data: an ordered list of layers, each a token mixer plus a feed-forward.

This one description drives everything: the model is built from it, HF checkpoints are converted to
it, and the KV-cache plan is derived from it (``HybridConfig.kv_specs``), so a custom layer mix gets
its cache groups for free::

    cfg = HybridConfig(vocab_size=1000, hidden_size=256, layers=(
        Layer(mixer=Mamba2(num_heads=8, head_dim=32, state_size=16), ffn=MLP(intermediate_size=512)),
        Layer(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=64)),
        Layer(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=64, attention_chunk_size=128)),
        Layer(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=64, rope=None)),   # global NoPE
    ))

Each mixer kind's config (``Attention``, ``Mamba2``, ...) lives in its layer module with the hooks the plan, the
model and the memory check call (``layers/kind.py``); this module imports every built-in kind, which registers it,
and re-exports its config under the same name. The feed-forwards, the layer and the whole model are defined here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.config_base import MAX_DIM, check_fields, positive
from hybridkv.kv_groups.specs import DEFAULT_BLOCK_SIZE, KVCacheSpec

# The mixer kinds: each config class lives in its layer module and registers itself there (``layers/kind.py``).
from hybridkv.layers.attention import Attention
from hybridkv.layers.gated_deltanet import GatedDeltaNet
from hybridkv.layers.kimi_delta import KimiDeltaAttention
from hybridkv.layers.kind import CacheContext, MixerConfig, mixer_kinds
from hybridkv.layers.mamba1 import Mamba1
from hybridkv.layers.mamba2 import Mamba2
from hybridkv.layers.mla import MultiLatentAttention
from hybridkv.layers.parallel import local_units
from hybridkv.layers.rotary import ROPE_SCALINGS, Rope
from hybridkv.layers.short_conv import ShortConv

__all__ = ["ACTIVATIONS", "GATED_ONLY_ACTIVATIONS", "MAX_DIM", "MAX_LAYERS", "MLP", "MOE_ROUTERS", "NORMS",
           "ROPE_SCALINGS", "AltUp", "Attention", "DenseMoE", "FeedForward", "GatedDeltaNet", "HybridConfig",
           "KimiDeltaAttention", "Layer", "Mamba1", "Mamba2", "Mixer", "MixerConfig", "MoE", "MultiLatentAttention",
           "Rope", "SharedBlock", "ShortConv"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2")
# Gated activations that are not ``act(gate) * up``: gpt-oss's clamped SwiGLU (``MoE.activation``).
GATED_ONLY_ACTIVATIONS = ("swiglu_oai",)
NORMS = ("rms", "gemma_rms", "layer")
MOE_ROUTERS = ("softmax", "sigmoid_input", "sigmoid_bias", "topk_softmax")

# Sanity bound (``MAX_DIM`` in ``config_base`` bounds every int): a decoder's modules are built one Python object
# per layer, so the layer count bounds the build time (a meta build of MAX_LAYERS small layers takes 1-2 s).
MAX_LAYERS = 1024


@dataclass(frozen=True, kw_only=True)
class MLP:
    """Dense feed-forward: gated (SwiGLU / GeGLU) or plain (e.g. relu² in NemotronH).

    Gated: ``down(act(gate(x) * gate_multiplier) * up(x)) * down_multiplier`` (the multipliers are
    Falcon-H1's µP factors, 1 elsewhere). ``activation_sparsity`` s > 0 (Gemma-3n's first layers): the gate keeps
    only what exceeds its per-token Gaussian s-quantile, ``relu(g - (mean(g) + std(g) * Phi^-1(s)))``, before
    the activation."""

    intermediate_size: int
    activation: str = "silu"
    gated: bool = True
    bias: bool = False
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0
    activation_sparsity: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self)
        positive("MLP", intermediate_size=self.intermediate_size)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLP.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not 0.0 <= self.activation_sparsity < 1.0 or (self.activation_sparsity and not self.gated):
            raise ValueError(f"MLP.activation_sparsity must be in [0, 1) and needs a gated MLP, got "
                             f"{self.activation_sparsity} (gated={self.gated})")


@dataclass(frozen=True, kw_only=True)
class MoE:
    """Routed experts plus optional shared experts.

    ``router``: "softmax" (top-k of softmax, optionally renormalised), "sigmoid_input" (Llama-4: sigmoid
    top-k weights scale the expert *input*), "sigmoid_bias" (NemotronH: sigmoid scores with a
    correction bias for selection, weights renormalised and scaled by ``routed_scaling_factor``),
    "topk_softmax" (gpt-oss: softmax over the top-k logits; ``renormalize`` is moot, the k weights sum to 1).
    ``router_bias``: the router linear has a bias (gpt-oss).

    ``activation``: one of ``ACTIVATIONS`` (``act(gate) * up``, or ``act(up)`` ungated) or "swiglu_oai"
    (gpt-oss, gated only): ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)``,
    ``alpha = swiglu_alpha``, ``L = swiglu_limit``. ``bias``: the experts' gate/up and down projections have
    biases (gpt-oss).

    NemotronH extras: selection first keeps the ``topk_groups`` best of ``num_groups`` expert groups
    (group score = sum of its two best corrected scores), and with ``latent_size`` the routed experts
    run in a smaller latent space (hidden -> latent projection before, latent -> hidden after). The
    shared expert (``shared_intermediate_size`` > 0) sees the layer input and uses the experts'
    activation and gating; with ``shared_gate`` (Qwen2-MoE, Qwen3-Next) its output is scaled by
    sigmoid(x . w), one learned vector w (``shared_expert_gate``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax"
    renormalize: bool = True
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    gated: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    latent_size: int | None = None
    router_bias: bool = False
    bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        positive("MoE", num_experts=self.num_experts, top_k=self.top_k,
                 intermediate_size=self.intermediate_size)
        if self.top_k > self.num_experts:
            raise ValueError(f"MoE.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.router not in MOE_ROUTERS:
            raise ValueError(f"MoE.router must be one of {MOE_ROUTERS}, got {self.router!r}")
        if self.activation not in ACTIVATIONS + GATED_ONLY_ACTIVATIONS:
            raise ValueError(f"MoE.activation must be one of {ACTIVATIONS + GATED_ONLY_ACTIVATIONS}, "
                             f"got {self.activation!r}")
        if self.activation in GATED_ONLY_ACTIVATIONS and (not self.gated or self.shared_intermediate_size):
            raise ValueError(f"MoE.activation {self.activation!r} needs gated experts and no shared expert")
        positive("MoE", swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        positive("MoE", num_groups=self.num_groups, topk_groups=self.topk_groups,
                 latent_size=self.latent_size)
        if self.shared_intermediate_size < 0:
            raise ValueError(f"MoE.shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("MoE.shared_gate needs a shared expert (shared_intermediate_size > 0)")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"MoE: num_groups={self.num_groups} must divide num_experts={self.num_experts} "
                             f"and be >= topk_groups={self.topk_groups}")


@dataclass(frozen=True, kw_only=True)
class SharedBlock:
    """Zamba2's shared transformer block, run at the start of a layer, before its mixer::

        t = linear(mlp(norm2(attention(norm1(concat(x, embeddings))))))    # no residual inside
        x = x + mixer(norm(x + t))

    ``embeddings`` are the token embeddings (the model input), so attention and its pre-norm are
    2 * hidden wide when ``concat_embeddings``. Uses with the same ``block_id`` share attention, MLP
    and norm weights but each keeps its own KV cache; ``linear`` belongs to the layer. With
    ``adapter_rank`` > 0 every use ``use_index`` (its ordinal among all shared-block uses) adds its own
    low-rank adapter to the MLP's gate_up projection and, with ``attention_adapters``, to q, k and v."""

    block_id: int
    use_index: int
    attention: Attention
    mlp: MLP
    concat_embeddings: bool = True
    adapter_rank: int = 0
    attention_adapters: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if self.block_id < 0 or self.use_index < 0 or self.adapter_rank < 0:
            raise ValueError(f"SharedBlock: block_id, use_index and adapter_rank must be >= 0, got "
                             f"{self.block_id}, {self.use_index}, {self.adapter_rank}")
        if self.attention_adapters and not self.adapter_rank:
            raise ValueError("SharedBlock.attention_adapters needs adapter_rank > 0")


@dataclass(frozen=True, kw_only=True)
class DenseMoE:
    """Gemma-4's MoE block (26B-A4B): a dense MLP and routed experts side by side, each with its own norms, summed::

        y = post_mlp_norm(mlp(n)) + post_moe_norm(experts(moe_norm(x)))     # n = the layer's ffn norm of x

    The router reads the layer's input ``x`` itself: ``proj(rms(x) * scale * hidden^-0.5)`` (``rms``: no weight;
    ``scale``: a learned vector), softmax, top-k, renormalised, then each weight times its expert's learned
    ``per_expert_scale``. ``moe.router`` must be "softmax" with ``renormalize``; no shared expert."""

    mlp: MLP
    moe: MoE

    def __post_init__(self) -> None:
        check_fields(self)
        if self.moe.router != "softmax" or not self.moe.renormalize or self.moe.shared_intermediate_size \
                or self.moe.latent_size or not self.moe.gated:
            raise ValueError("DenseMoE.moe: a gated softmax router with renormalize, no shared expert or latent space")

    @property
    def activation(self) -> str:
        return self.mlp.activation


@dataclass(frozen=True, kw_only=True)
class AltUp:
    """Gemma-3n's alternating updates: the residual stream is ``num_inputs`` parallel streams. The embeddings
    become stream 0 and ``num_inputs - 1`` projections of them (rescaled to its RMS); each layer first *predicts*
    every stream as a router-weighted mix of all of them (the router reads the stream ``active_index``), runs on
    the active prediction only, then *corrects* every prediction by the layer's innovation (its output minus the
    active prediction) times router-given coefficients; the per-layer input (scaled by the learned
    ``correct_output_scale`` when ``correct_scale``) joins streams 1 onwards. The final hidden state is the mean of
    stream 0 and the other streams' unembedding projections (each rescaled to stream 0's RMS)."""

    num_inputs: int
    active_index: int = 0
    correct_scale: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_inputs < 2 or not 0 <= self.active_index < self.num_inputs:
            raise ValueError(f"AltUp: num_inputs must be >= 2 and active_index in [0, num_inputs), got "
                             f"{self.num_inputs}, {self.active_index}")


# Every registered mixer kind (``layers/kind.py``): the built-in ones, imported above, register themselves.
Mixer = functools.reduce(operator.or_, mixer_kinds().values())
FeedForward = MLP | MoE | DenseMoE


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One decoder layer: ``x += mixer(norm(x)); x += ffn(norm(x))``. Either part may be absent
    (NemotronH layers are one of mamba / attention / mlp / moe). ``parallel_mixer`` runs beside the
    mixer on the same normed input and their outputs are added (Falcon-H1: attention + Mamba2).
    ``sandwich_norm`` adds the Gemma-2/3 post-norms; with ``pre_norm=False`` the pre-norms go, leaving
    post-norms only, ``x += norm(mixer(x))`` (Olmo-2, Exaone-4). ``parallel_ffn``: the feed-forward reads
    the mixer's normed input and both join the residual at once, ``x += mixer(norm(x)) + ffn(norm(x))``
    (Cohere). ``shared_block`` (Zamba2) runs first and feeds the mixer's input (see ``SharedBlock``)."""

    mixer: Mixer | None = None
    parallel_mixer: Mamba2 | None = None
    ffn: FeedForward | None = None
    sandwich_norm: bool = False
    shared_block: SharedBlock | None = None
    pre_norm: bool = True
    parallel_ffn: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if self.mixer is None and self.ffn is None:
            raise ValueError("Layer needs a mixer, a feed-forward, or both")
        if self.mixer is not None and not isinstance(self.mixer, Mixer):
            raise ValueError(f"Layer.mixer: unknown kind {type(self.mixer).__name__}")
        if self.parallel_mixer is not None and not isinstance(self.mixer, Attention):
            raise ValueError("Layer.parallel_mixer needs an Attention mixer beside it")
        if self.ffn is not None and not isinstance(self.ffn, MLP | MoE | DenseMoE):
            raise ValueError(f"Layer.ffn: unknown kind {type(self.ffn).__name__}")
        if self.shared_block is not None and self.mixer is None:
            raise ValueError("Layer.shared_block needs a mixer to feed")
        if self.parallel_ffn and (self.mixer is None or self.ffn is None or self.sandwich_norm
                                  or not self.pre_norm or isinstance(self.ffn, DenseMoE)):
            raise ValueError("Layer.parallel_ffn needs a mixer and a feed-forward, pre-norm only")
        if not self.pre_norm and self.shared_block is not None:
            raise ValueError("Layer.pre_norm=False does not combine with a shared block")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """The whole decoder. ``norm``: "rms", "gemma_rms" ((1 + w) scaling) or "layer" (LayerNorm without bias,
    Cohere); it is every norm of the model (q/k norms: "rms" and "gemma_rms" only).

    ``embedding_multiplier`` scales the token embeddings (Gemma: sqrt(hidden), which HF rounds to the
    weight dtype first; Falcon-H1, Granite: µP), ``residual_multiplier`` every block output before it
    is added (Granite), ``logits_multiplier`` the logits (Falcon-H1 lm_head_multiplier, Granite
    1 / logits_scaling) before ``final_softcap``. ``residual_in_fp32`` keeps the residual stream in
    fp32 (HF Mamba2).

    Gemma-3n / Gemma-4 per-layer inputs (``per_layer_input_size`` P > 0): a second embedding table
    (``per_layer_vocab_size`` x layers * P, scaled by sqrt(P)) plus a projection of the scaled token embeddings
    (x hidden^-0.5, then an RMS norm over P), summed and scaled by 2^-0.5, gives every layer its own P-wide input;
    after its feed-forward each layer adds ``norm(proj(act(gate(x)) * input))`` (act: the first feed-forward's
    activation). ``layer_scalar``: each layer's output is multiplied by a learned scalar (a checkpoint tensor).

    Gemma-3n: ``altup`` (see ``AltUp``) and ``laurel_rank`` R > 0, the learned augmented residual: beside the mixer
    every layer computes ``n + norm(right(left(n)))`` (n: the normed layer input, a rank-R bottleneck) and the
    residual after the mixer becomes ``(h + laurel) / sqrt(2)``. Both need sandwich-normed attention + MLP layers."""

    vocab_size: int
    hidden_size: int
    layers: tuple[Layer, ...]
    norm: str = "rms"
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    final_softcap: float | None = None
    residual_in_fp32: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    architecture: str = "HybridForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    layer_scalar: bool = False
    altup: AltUp | None = None
    laurel_rank: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layers, tuple | list) and len(self.layers) > MAX_LAYERS:   # before looking at each
            raise ValueError(f"HybridConfig.layers: {len(self.layers)} layers is more than the {MAX_LAYERS} "
                             f"supported (a config error?)")
        check_fields(self)
        positive("HybridConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                 max_position_embeddings=self.max_position_embeddings, norm_eps=self.norm_eps)
        if not self.layers:
            raise ValueError("HybridConfig.layers is empty")
        if self.norm not in NORMS:
            raise ValueError(f"HybridConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"HybridConfig.dtype: unknown torch dtype {self.dtype!r}")
        if self.residual_in_fp32 and not all(layer.pre_norm for layer in self.layers):
            raise ValueError("HybridConfig.residual_in_fp32 needs pre-norms (Layer.pre_norm): a post-norm-only layer "
                             "reads the residual stream itself")
        if self.norm == "layer" and any(isinstance(m, Attention) and m.qk_norm == "rms"
                                        for _, m in self.stateful_mixers()):
            raise ValueError("HybridConfig.norm='layer' has no q/k norm flavour (Attention.qk_norm='rms')")
        if self.per_layer_input_size < 0 or (self.per_layer_vocab_size is not None and self.per_layer_vocab_size < 1):
            raise ValueError(f"HybridConfig: per_layer_input_size must be >= 0 and per_layer_vocab_size >= 1, got "
                             f"{self.per_layer_input_size}, {self.per_layer_vocab_size}")
        if self.per_layer_input_size and not any(layer.ffn is not None for layer in self.layers):
            raise ValueError("HybridConfig.per_layer_input_size needs feed-forwards (their activation gates the input)")
        self._check_kv_sharing()
        self._check_altup()
        shared: dict[int, SharedBlock] = {}
        for i, layer in enumerate(self.layers):
            block = layer.shared_block
            if block is not None:
                first = shared.setdefault(block.block_id, block)
                if (first.attention, first.mlp, first.concat_embeddings) != (
                        block.attention, block.mlp, block.concat_embeddings):
                    raise ValueError(f"HybridConfig.layers[{i}]: shared block {block.block_id} differs from "
                                     f"its first use; uses of one block share weights, so must match")

    def _check_altup(self) -> None:
        if self.laurel_rank < 0:
            raise ValueError(f"HybridConfig.laurel_rank must be >= 0, got {self.laurel_rank}")
        if self.altup is None and not self.laurel_rank:
            return
        if self.altup is None:
            raise ValueError("HybridConfig.laurel_rank needs altup (Gemma-3n's layer is the only one built with it)")
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer.mixer, Attention) and isinstance(layer.ffn, MLP | MoE) and layer.sandwich_norm
                    and layer.pre_norm and layer.parallel_mixer is None and layer.shared_block is None
                    and not layer.parallel_ffn):
                raise ValueError(f"HybridConfig.layers[{i}]: altup needs sandwich-normed attention + MLP layers")
        if self.layer_scalar or self.residual_multiplier != 1.0 or self.residual_in_fp32:
            raise ValueError("HybridConfig.altup does not combine with layer_scalar, residual_multiplier or "
                             "residual_in_fp32")

    def _check_kv_sharing(self) -> None:
        """A KV-sharing layer (``Attention.kv_source``) names an earlier attention layer that owns its cache, with
        the same cache shape and kind (kv heads, head dim, window / chunk)."""
        for i, layer in enumerate(self.layers):
            mixer = layer.mixer
            if not isinstance(mixer, Attention) or mixer.kv_source is None:
                continue
            j = mixer.kv_source
            donor = self.layers[j].mixer if j < i else None
            if not isinstance(donor, Attention) or donor.kv_source is not None:
                raise ValueError(f"HybridConfig.layers[{i}]: kv_source={j} must name an earlier attention layer "
                                 f"that keeps its own KV cache")
            mine = (mixer.num_kv_heads, mixer.head_dim, mixer.sliding_window, mixer.attention_chunk_size)
            theirs = (donor.num_kv_heads, donor.head_dim, donor.sliding_window, donor.attention_chunk_size)
            if mine != theirs:
                raise ValueError(f"HybridConfig.layers[{i}]: reads layer {j}'s KV cache but its (kv heads, head dim, "
                                 f"window, chunk) {mine} differ from the donor's {theirs}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def layer_cache_name(self, index: int, *, parallel: bool = False, shared: bool = False) -> str:
        """Name of layer ``index``'s cache in the KV-cache plan (``parallel``: its parallel mixer's;
        ``shared``: its shared block's attention)."""
        if parallel:
            return f"layers.{index}.parallel"
        return f"layers.{index}.shared" if shared else f"layers.{index}"

    def stateful_mixers(self) -> list[tuple[str, Mixer]]:
        """(cache name, mixer) for every mixer that keeps per-request state, in execution order."""
        out: list[tuple[str, Mixer]] = []
        for i, layer in enumerate(self.layers):
            if layer.shared_block is not None:
                out.append((self.layer_cache_name(i, shared=True), layer.shared_block.attention))
            if layer.mixer is not None:
                out.append((self.layer_cache_name(i), layer.mixer))
            if layer.parallel_mixer is not None:
                out.append((self.layer_cache_name(i, parallel=True), layer.parallel_mixer))
        return out

    def default_block_size(self, preferred: int = DEFAULT_BLOCK_SIZE) -> int:
        """``preferred`` unless a chunked-local layer's chunk is not a multiple of it: then the largest
        block size that divides every chunk (a chunk must start on a block boundary)."""
        chunks = [m.attention_chunk_size for _, m in self.stateful_mixers()
                  if isinstance(m, Attention) and m.attention_chunk_size]
        return math.gcd(preferred, *chunks)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` naming the first layer and dimension that ``tensor_parallel_size`` ranks
        cannot split (docs/parallelism.md has the rules). The vocabulary is padded, so it never fails."""
        tp = tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")

        def check(where: str, units: int, what: str, replicate: bool = False) -> None:
            try:
                local_units(units, tp, what, replicate=replicate)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

        def check_ffn(where: str, ffn: FeedForward) -> None:
            if isinstance(ffn, DenseMoE):
                check_ffn(where, ffn.mlp)
                check_ffn(where, ffn.moe)
                return
            check(where, ffn.intermediate_size, f"{type(ffn).__name__}.intermediate_size")
            if isinstance(ffn, MLP) and ffn.activation_sparsity and tp > 1:     # its statistics span the full width
                raise ValueError(f"{where}: MLP.activation_sparsity is not supported with tensor parallelism")
            if isinstance(ffn, MoE) and ffn.shared_intermediate_size:
                check(where, ffn.shared_intermediate_size, "MoE.shared_intermediate_size")

        for name, mixer in self.stateful_mixers():
            try:
                mixer.check_tensor_parallel(tp)
            except ValueError as err:
                raise ValueError(f"{name} ({type(mixer).__name__}): {err}") from None
        for i, layer in enumerate(self.layers):
            if layer.ffn is not None:
                check_ffn(f"layers.{i}.ffn", layer.ffn)
            if layer.shared_block is not None:
                check_ffn(f"layers.{i}.shared_block.mlp", layer.shared_block.mlp)

    def kv_specs(self, *, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: torch.dtype | None = None,
                 conv_state_dtype: torch.dtype | None = None,
                 tensor_parallel_size: int = 1) -> dict[str, KVCacheSpec]:
        """Layer cache name -> KV-cache spec (its mixer kind's ``cache_spec``), for every layer that keeps
        per-request state.

        KV and conv states (Mamba's and ShortConv's) default to the model dtype; the SSM state is always fp32. A
        window or chunk of at least ``max_position_embeddings`` behaves as full attention and is planned as such. With
        ``tensor_parallel_size`` > 1 the specs are one rank's: its kv heads (replicated when fewer than the
        ranks) and its Mamba heads / channels; block counts, tables and slots are the same on every rank."""
        tp = tensor_parallel_size
        if tp > 1:
            self.check_tensor_parallel(tp)
        specs: dict[str, KVCacheSpec] = {}

        def layer_cache(index: int) -> tuple[str, KVCacheSpec]:
            name = self.layer_cache_name(index)
            return name, specs[name]

        kv_dtype = kv_dtype or self.torch_dtype
        ctx = CacheContext(block_size=block_size, kv_dtype=kv_dtype, conv_dtype=conv_state_dtype or kv_dtype,
                           tensor_parallel_size=tp, max_positions=self.max_position_embeddings,
                           layer_cache=layer_cache)
        for name, mixer in self.stateful_mixers():
            try:
                spec = mixer.cache_spec(ctx)
            except ValueError as err:
                raise ValueError(f"{name} ({type(mixer).__name__}): {err}") from None
            if spec is not None:
                specs[name] = spec
        return specs

    # -- (de)serialisation: config.json next to model.safetensors -------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def encode(obj: Any) -> Any:
            if dataclasses.is_dataclass(obj):
                out = {"type": type(obj).__name__}
                out.update({f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
                return out
            if isinstance(obj, tuple):
                return [encode(x) for x in obj]
            if isinstance(obj, float) and math.isinf(obj):
                return "inf"
            return obj

        return {"hybridkv_config": encode(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HybridConfig:
        mixers = mixer_kinds()
        types = {**mixers, **{t.__name__: t for t in (Rope, MLP, MoE, DenseMoE, AltUp, SharedBlock, Layer,
                                                      HybridConfig)}}

        def decode(obj: Any, where: str) -> Any:
            if isinstance(obj, dict) and "type" in obj:
                kind = obj["type"]
                if kind not in types:
                    raise ValueError(f"{where}: unknown config type {kind!r} (known: {sorted(types)})")
                fields = {k: decode(v, f"{where}.{k}") for k, v in obj.items() if k != "type"}
                try:
                    if kind in mixers:
                        fields = types[kind].saved_fields(fields)
                    return types[kind](**fields)
                except (TypeError, ValueError) as err:    # nested errors were prefixed where they arose
                    raise ValueError(f"{where}: {err}") from None
            if isinstance(obj, list):
                return tuple(decode(x, f"{where}[{i}]") for i, x in enumerate(obj))
            return math.inf if obj == "inf" else obj

        if not isinstance(data, dict) or "hybridkv_config" not in data:
            raise ValueError("not a hybridkv config: missing the 'hybridkv_config' key")
        body = data["hybridkv_config"]
        if not isinstance(body, dict) or body.get("type") != "HybridConfig":
            raise ValueError("config: 'hybridkv_config' must be an object of type HybridConfig")
        layers = body.get("layers")
        if isinstance(layers, list) and len(layers) > MAX_LAYERS:      # refused before decoding each one
            raise ValueError(f"config.layers: {len(layers)} layers is more than the {MAX_LAYERS} supported "
                             f"(a config error?)")
        return decode(body, "config")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> HybridConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

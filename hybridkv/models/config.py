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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.kv_groups.specs import (
    DEFAULT_BLOCK_SIZE,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVSharingSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.layers.parallel import local_units

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2")
# Gated activations that are not ``act(gate) * up``: gpt-oss's clamped SwiGLU (``MoE.activation``).
GATED_ONLY_ACTIVATIONS = ("swiglu_oai",)
ROPE_SCALINGS = (None, "linear", "llama3", "yarn", "proportional")
NORMS = ("rms", "gemma_rms", "layer")
MOE_ROUTERS = ("softmax", "sigmoid_input", "sigmoid_bias", "topk_softmax")

# Sanity bounds: far beyond any released model, low enough that a config.json typo (hidden_size=10**9,
# num_hidden_layers=10**6) is an error before anything is built. Sizes are int32 on the device (kernel
# indices, offsets); a decoder's modules are built one Python object per layer, so the layer count bounds
# the build time (a meta build of MAX_LAYERS small layers takes 1-2 s).
MAX_DIM = 2**31 - 1
MAX_LAYERS = 1024


def _positive(owner: str, **values: float | int | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(hint: Any) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _conform(value: Any, hint: Any, where: str, *, in_tuple: bool = False) -> Any:
    """``value`` as field type ``hint`` says (JSON's lists become tuples, ints become floats where a float is
    expected, 0/1 become bools), or a ``ValueError`` naming the field. Ints are bounded by ``MAX_DIM``; scalar
    floats must be finite (tuple entries may be infinite, e.g. an open ``time_step_limit``, but not NaN)."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        kinds = [o for o in options if o is not type(None)]
        if all(dataclasses.is_dataclass(o) for o in kinds) and not isinstance(value, tuple(kinds)):
            raise ValueError(f"{where}: unknown kind {type(value).__name__} (expected "
                             f"{' or '.join(_type_name(o) for o in kinds)})")
        errors = []
        for option in kinds:
            try:
                return _conform(value, option, where, in_tuple=in_tuple)
            except ValueError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        raise ValueError(f"{where} must be {' or '.join(_type_name(o) for o in options)}, got {value!r}")
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple | list):
            raise ValueError(f"{where} must be a list, got {value!r} ({type(value).__name__})")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(value) != len(args):
            raise ValueError(f"{where} needs {len(args)} values, got {list(value)!r}")
        return tuple(_conform(v, a, f"{where}[{i}]", in_tuple=True)
                     for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"{where} must be an integer, got {value!r} ({type(value).__name__})")
        if abs(value) > MAX_DIM:
            raise ValueError(f"{where}={value} is out of range (at most {MAX_DIM})")
        return int(value)
    if hint is float:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
        try:
            number = float(value)
        except OverflowError:               # an int beyond any float
            number = math.inf
        if math.isnan(number) or (math.isinf(number) and not in_tuple):
            raise ValueError(f"{where} must be finite, got {value!r}")
        return number
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"{where} must be a {_type_name(hint)}, got {value!r} ({type(value).__name__})")
    return value


def _check_fields(obj: Any) -> None:
    """Conform every field of the frozen dataclass ``obj`` to its annotation (see ``_conform``); the first
    thing each config class's ``__post_init__`` does, so the value checks after it see the right types."""
    owner = type(obj).__name__
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        conformed = _conform(value, hint, f"{owner}.{name}")
        if conformed is not value:
            object.__setattr__(obj, name, conformed)


@dataclass(frozen=True, kw_only=True)
class Rope:
    """Rotary embedding. ``interleaved`` rotates pairs (x[2i], x[2i+1]) (Llama-4, GPT-J); otherwise
    the halves are rotated (NeoX / Llama / Mistral / Gemma). ``scaling``: None, "linear", "llama3" or "yarn".

    YaRN (gpt-oss) reads ``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` (the
    ramp between interpolated and extrapolated frequencies), ``truncate`` (round the ramp's ends to whole
    dims) and the attention factor: ``attention_factor``, else from ``mscale`` / ``mscale_all_dim`` when both are
    set, else ``0.1 ln(factor) + 1`` (HF's ``_compute_yarn_parameters``; ``layers/rotary.py``).

    "proportional" (Gemma-4's global layers): the halves of the whole head are rotated, but only the first
    ``partial_rotary_factor * head_dim / 2`` frequencies are non-zero (``1 / theta^(2i / head_dim)``, divided by
    ``factor``); the rest rotate by 0, i.e. pass through (HF's ``_compute_proportional_rope_parameters``)."""

    theta: float = 10000.0
    interleaved: bool = False
    partial_rotary_factor: float = 1.0
    scaling: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("Rope", theta=self.theta, factor=self.factor, low_freq_factor=self.low_freq_factor,
                  high_freq_factor=self.high_freq_factor,
                  original_max_position_embeddings=self.original_max_position_embeddings)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"Rope.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"Rope.scaling must be one of {ROPE_SCALINGS}, got {self.scaling!r}")
        _positive("Rope", beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                  attention_factor=self.attention_factor)


@dataclass(frozen=True, kw_only=True)
class Attention:
    """Softmax attention over a paged KV cache: full, sliding-window or chunked-local.

    ``rope=None`` is NoPE. ``qk_norm``: None, "rms" (learned per-head-dim weight) or "rms_weightless"
    (Llama-4, applied after RoPE). ``temperature_tuning=(attn_scale, floor_scale)`` scales q on Llama-4
    NoPE layers by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)). ``shared_id`` marks layers
    that share weights (Zamba2) while keeping separate KV caches.

    "rms" q/k norms are learned per head dim, use the model's norm flavour (``HybridConfig.norm``) and
    run before RoPE (Gemma-3); "rms_weightless" runs after RoPE with ``HybridConfig.norm_eps`` (Llama-4);
    "rms_full" is one plain RMS norm over all heads' channels of q (and of k), weight (heads * head_dim,), on the
    projections before RoPE (OLMo-2/3, OLMo-Hybrid).
    ``scale`` overrides head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5; Granite:
    attention_multiplier). Falcon-H1 µP multipliers: the input is scaled by ``input_multiplier``, keys by
    ``key_multiplier`` (after k_proj, before RoPE), the output by ``output_multiplier``.

    ``sinks`` (gpt-oss): a learned logit per query head that joins every softmax's denominator and carries no
    value (``layers/ops/attention_ref.py``); a parameter of the layer, nothing in the KV cache.

    ``output_gate`` (Qwen3-Next): q_proj also gives a gate per query head (its rows per head [q | gate], as HF
    stores them); the attention output is multiplied by sigmoid(gate) before o_proj.

    Gemma-4: ``value_norm`` normalises each value head (RMS, no weight) before the cache; ``k_eq_v`` has no v_proj,
    the values are the keys as projected (before the k norm and RoPE). ``kv_source`` (cross-layer KV sharing,
    Gemma-3n / Gemma-4) is the index of an earlier layer whose KV cache this layer reads: it has only q_proj,
    q_norm and o_proj, keeps no cache and writes none (``KVSharingSpec``); kv heads, head dim and window must be
    its donor's."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    rope: Rope | None = Rope()
    qk_norm: str | None = None
    scale: float | None = None
    softcap: float | None = None
    temperature_tuning: tuple[float, float] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    shared_id: int | None = None
    input_multiplier: float = 1.0
    key_multiplier: float = 1.0
    output_multiplier: float = 1.0
    sinks: bool = False
    output_gate: bool = False
    value_norm: bool = False
    k_eq_v: bool = False
    kv_source: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.kv_source is not None and self.kv_source < 0:
            raise ValueError(f"Attention.kv_source must be a layer index >= 0, got {self.kv_source}")
        if self.kv_source is not None and self.k_eq_v:
            raise ValueError("Attention: a KV-sharing layer (kv_source) has no k/v projections; k_eq_v does not apply")
        _positive("Attention", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                  head_dim=self.head_dim, sliding_window=self.sliding_window,
                  attention_chunk_size=self.attention_chunk_size, scale=self.scale, softcap=self.softcap)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Attention.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError("Attention: set sliding_window or attention_chunk_size, not both")
        if self.qk_norm not in (None, "rms", "rms_weightless", "rms_full"):
            raise ValueError(f"Attention.qk_norm must be None, 'rms', 'rms_weightless' or 'rms_full', "
                             f"got {self.qk_norm!r}")

    @property
    def kind(self) -> str:
        if self.sliding_window is not None:
            return "sliding_window"
        return "chunked_local" if self.attention_chunk_size is not None else "full"

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


@dataclass(frozen=True, kw_only=True)
class Mamba2:
    """Mamba2 mixer (HF semantics, docs/design.md "Semantics"). State per request: conv (conv_dim, conv_kernel - 1)
    and SSM (num_heads, head_dim, state_size) in fp32.

    The output is gated by an RMSNorm over ``n_groups`` groups of the inner dim, ``norm(y * silu(z))``
    (``norm_before_gate``: ``norm(y) * silu(z)``); with ``gated_norm=False`` it is plain ``y * silu(z)``
    (Falcon-H1 without mamba_rms_norm). ``proj_bias`` is the in_proj bias and, unless ``out_proj_bias``
    says otherwise, the out_proj bias. Falcon-H1 µP: the input is scaled by ``input_multiplier``, the
    in_proj output's z, x, B, C, dt sections by ``zxbcdt_multipliers``, the output by
    ``output_multiplier``."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    out_proj_bias: bool | None = None
    norm_eps: float = 1e-5
    gated_norm: bool = True
    norm_before_gate: bool = False
    input_multiplier: float = 1.0
    zxbcdt_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    output_multiplier: float = 1.0

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("Mamba2", num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size,
                  n_groups=self.n_groups, conv_kernel=self.conv_kernel, chunk_size=self.chunk_size)
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2.n_groups={self.n_groups} must divide num_heads={self.num_heads}")
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(f"Mamba2.time_step_limit must be (low, high) with 0 <= low <= high, "
                             f"got {self.time_step_limit!r}")
        _positive("Mamba2", norm_eps=self.norm_eps)

    @property
    def kind(self) -> str:
        return "mamba2"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, SSM state) shapes on one tensor-parallel rank: its heads, and its groups (split, or
        the one group its heads read when n_groups < tensor_parallel_size)."""
        tp = tensor_parallel_size
        heads = local_units(self.num_heads, tp, "num_heads")
        groups = local_units(self.n_groups, tp, "n_groups", replicate=True)
        conv_dim = heads * self.head_dim + 2 * groups * self.state_size
        return (conv_dim, self.conv_kernel - 1), (heads, self.head_dim, self.state_size)


@dataclass(frozen=True, kw_only=True)
class Mamba1:
    """Mamba-1 selective-scan mixer (Jamba: with RMS norms on dt, B and C)."""

    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel: int = 4
    dt_norm: bool = False
    conv_bias: bool = True
    proj_bias: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("Mamba1", intermediate_size=self.intermediate_size, state_size=self.state_size,
                  dt_rank=self.dt_rank, conv_kernel=self.conv_kernel)

    @property
    def kind(self) -> str:
        return "mamba1"

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, SSM state) shapes on one tensor-parallel rank: its share of the channels."""
        inter = local_units(self.intermediate_size, tensor_parallel_size, "intermediate_size")
        return (inter, self.conv_kernel - 1), (inter, self.state_size)


@dataclass(frozen=True, kw_only=True)
class ShortConv:
    """LFM2's gated short convolution (HF ``Lfm2ShortConv``): ``in_proj`` gives B, C, x (``channels`` each),
    ``y = out_proj(C * conv(B * x))`` with a depthwise causal conv of width ``conv_kernel`` (HF ``conv_L_cache``)
    and no activation. State per request: the conv state (channels, conv_kernel - 1), the last gated inputs;
    ``bias`` is HF's ``conv_bias``, which biases in_proj, the conv and out_proj alike."""

    channels: int
    conv_kernel: int = 3
    bias: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("ShortConv", channels=self.channels, conv_kernel=self.conv_kernel)
        if self.conv_kernel < 2:
            raise ValueError(f"ShortConv.conv_kernel must be at least 2 (a state of width - 1 inputs), "
                             f"got {self.conv_kernel}")

    @property
    def kind(self) -> str:
        return "short_conv"

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state,) shape on one tensor-parallel rank: its share of the channels."""
        channels = local_units(self.channels, tensor_parallel_size, "channels")
        return ((channels, self.conv_kernel - 1),)


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNet:
    """Gated DeltaNet (HF ``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz`` gives q, k (``num_k_heads`` x
    ``head_k_dim``), v and the output gate z (``num_v_heads`` x ``head_v_dim``), grouped per key head as HF stores
    them; ``in_proj_ba`` gives b, a per value head. A depthwise causal conv (width ``conv_kernel``, SiLU, no bias)
    runs over q|k|v; then the gated delta rule (``layers/ops/gated_delta_ref.py``) with L2-normalised q/k, the log
    decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; the output is
    ``out_proj(norm(o) * silu(z))``, an RMS norm per value head (weight (head_v_dim,), eps ``norm_eps``).

    ``projections``: "grouped" (Qwen3-Next, as above) or "flat" (Qwen3.5, OLMo-Hybrid): ``in_proj_qkv`` gives
    [q | k | v] in the conv's channel order, ``in_proj_z`` the gate, ``in_proj_b`` / ``in_proj_a`` b and a, each
    per head in head order. ``beta_scale`` multiplies beta (OLMo-Hybrid's ``linear_allow_neg_eigval``: 2, so the
    delta rule's eigenvalues 1 - beta k.k reach [-1, 1]).

    State per request: the conv state (2 * key dim + value dim, conv_kernel - 1) and the recurrent state
    (num_v_heads, head_k_dim, head_v_dim) in fp32. ``chunk_size``: the chunked prefill's chunk."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    projections: str = "grouped"
    beta_scale: float = 1.0

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("GatedDeltaNet", num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                  head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel,
                  norm_eps=self.norm_eps, chunk_size=self.chunk_size)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"GatedDeltaNet.num_k_heads={self.num_k_heads} must divide "
                             f"num_v_heads={self.num_v_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"GatedDeltaNet.conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.projections not in ("grouped", "flat"):
            raise ValueError(f"GatedDeltaNet.projections must be 'grouped' or 'flat', got {self.projections!r}")
        _positive("GatedDeltaNet", beta_scale=self.beta_scale)

    @property
    def kind(self) -> str:
        return "gated_deltanet"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, recurrent state) shapes on one tensor-parallel rank: its key heads and the value heads
        they serve (the ranks must divide the key heads)."""
        k_heads = local_units(self.num_k_heads, tensor_parallel_size, "num_k_heads")
        v_heads = k_heads * (self.num_v_heads // self.num_k_heads)
        conv_dim = 2 * k_heads * self.head_k_dim + v_heads * self.head_v_dim
        return (conv_dim, self.conv_kernel - 1), (v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True, kw_only=True)
class KimiDeltaAttention:
    """Kimi Delta Attention (HF ``KimiLinearDeltaAttention``): the delta rule with a per-channel decay.
    ``q_proj`` / ``k_proj`` / ``v_proj`` give ``num_heads`` x ``head_dim`` each (keys and values alike); a depthwise
    causal conv (width ``conv_kernel``, SiLU, no bias) runs over q|k|v; the log decay per head and key channel is
    ``-exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (a low-rank gate), ``beta = sigmoid(b_proj(x))``;
    then KDA (``layers/ops/gated_delta_ref.py``) with L2-normalised q/k; the output is
    ``o_proj(norm(o) * sigmoid(g_b_proj(g_a_proj(x))))``, an RMS norm per head (weight (head_dim,), eps
    ``norm_eps``) gated by a sigmoid.

    State per request: the conv state (3 * num_heads * head_dim, conv_kernel - 1) and the recurrent state
    (num_heads, head_dim, head_dim) in fp32. ``chunk_size``: the chunked prefill's chunk."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    chunk_size: int = 64

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("KimiDeltaAttention", num_heads=self.num_heads, head_dim=self.head_dim,
                  conv_kernel=self.conv_kernel, norm_eps=self.norm_eps, chunk_size=self.chunk_size)
        if self.conv_kernel < 2:
            raise ValueError(f"KimiDeltaAttention.conv_kernel must be at least 2, got {self.conv_kernel}")

    @property
    def kind(self) -> str:
        return "kda"

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, recurrent state) shapes on one tensor-parallel rank: its heads."""
        heads = local_units(self.num_heads, tensor_parallel_size, "num_heads")
        return (3 * heads * self.head_dim, self.conv_kernel - 1), (heads, self.head_dim, self.head_dim)


@dataclass(frozen=True, kw_only=True)
class MultiLatentAttention:
    """Multi-head latent attention (MLA, DeepSeek-V2) as Kimi-Linear runs it (HF ``KimiLinearAttention``): NoPE,
    so the shared "rope" key part is used as projected, never rotated.

    q = ``q_proj(x)`` (or ``q_b_proj(norm(q_a_proj(x)))`` with ``q_lora_rank``), ``num_heads`` x (qk_nope_head_dim +
    qk_rope_head_dim); ``kv_a_proj_with_mqa(x)`` = [latent c (kv_lora_rank) | k_rope (qk_rope_head_dim)], c
    RMS-normed (``kv_a_layernorm``); ``kv_b_proj(c)`` gives each head's k_nope and v (v_head_dim); softmax scale
    (qk_nope_head_dim + qk_rope_head_dim) ** -0.5. The KV cache holds [c | k_rope] per token, one row of
    kv_lora_rank + qk_rope_head_dim shared by every head (``MLAAttentionSpec``), not per-head K and V.
    ``bias``: HF's ``attention_bias`` (kv_a_proj, q_a_proj and o_proj); ``norm_eps``: the latent norms' eps (HF
    builds them with its RMS norm's default, 1e-6, not the model's ``rms_norm_eps``)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    bias: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive("MultiLatentAttention", num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                  qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                  v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank, norm_eps=self.norm_eps)

    @property
    def kind(self) -> str:
        return "full"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5


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
        _check_fields(self)
        _positive("MLP", intermediate_size=self.intermediate_size)
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
        _check_fields(self)
        _positive("MoE", num_experts=self.num_experts, top_k=self.top_k,
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
        _positive("MoE", swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        _positive("MoE", num_groups=self.num_groups, topk_groups=self.topk_groups,
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
        _check_fields(self)
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
        _check_fields(self)
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
        _check_fields(self)
        if self.num_inputs < 2 or not 0 <= self.active_index < self.num_inputs:
            raise ValueError(f"AltUp: num_inputs must be >= 2 and active_index in [0, num_inputs), got "
                             f"{self.num_inputs}, {self.active_index}")


Mixer = Attention | Mamba2 | Mamba1 | ShortConv | GatedDeltaNet | KimiDeltaAttention | MultiLatentAttention
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
        _check_fields(self)
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
        _check_fields(self)
        _positive("HybridConfig", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
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
            where = f"{name} ({type(mixer).__name__})"
            if isinstance(mixer, Attention):
                check(where, mixer.num_heads, "num_heads")
                check(where, mixer.num_kv_heads, "num_kv_heads", replicate=True)
            elif isinstance(mixer, Mamba2):
                check(where, mixer.num_heads, "num_heads")
                check(where, mixer.n_groups, "n_groups", replicate=True)
            elif isinstance(mixer, ShortConv):
                check(where, mixer.channels, "channels")
            elif isinstance(mixer, GatedDeltaNet):
                check(where, mixer.num_k_heads, "num_k_heads")
            elif isinstance(mixer, KimiDeltaAttention | MultiLatentAttention):
                check(where, mixer.num_heads, "num_heads")
            else:
                check(where, mixer.intermediate_size, "intermediate_size")
        for i, layer in enumerate(self.layers):
            if layer.ffn is not None:
                check_ffn(f"layers.{i}.ffn", layer.ffn)
            if layer.shared_block is not None:
                check_ffn(f"layers.{i}.shared_block.mlp", layer.shared_block.mlp)

    def kv_specs(self, *, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: torch.dtype | None = None,
                 conv_state_dtype: torch.dtype | None = None,
                 tensor_parallel_size: int = 1) -> dict[str, KVCacheSpec]:
        """Layer cache name -> KV-cache spec, for every layer that keeps per-request state.

        KV and conv states (Mamba's and ShortConv's) default to the model dtype; the SSM state is always fp32. A
        window or chunk of at least ``max_position_embeddings`` behaves as full attention and is planned as such. With
        ``tensor_parallel_size`` > 1 the specs are one rank's: its kv heads (replicated when fewer than the
        ranks) and its Mamba heads / channels; block counts, tables and slots are the same on every rank."""
        tp = tensor_parallel_size
        if tp > 1:
            self.check_tensor_parallel(tp)
        kv_dtype = kv_dtype or self.torch_dtype
        conv_dtype = conv_state_dtype or kv_dtype
        limit = self.max_position_embeddings
        specs: dict[str, KVCacheSpec] = {}
        for name, mixer in self.stateful_mixers():
            try:
                if isinstance(mixer, MultiLatentAttention):     # one latent row per token, every rank whole
                    specs[name] = MLAAttentionSpec(block_size=block_size, kv_lora_rank=mixer.kv_lora_rank,
                                                   qk_rope_head_dim=mixer.qk_rope_head_dim, dtype=kv_dtype)
                elif isinstance(mixer, Attention) and mixer.kv_source is not None:
                    donor = self.layer_cache_name(mixer.kv_source)
                    target = specs[donor]
                    specs[name] = KVSharingSpec(block_size=block_size, donor=donor, target=target)
                elif isinstance(mixer, Attention):
                    kv_heads = local_units(mixer.num_kv_heads, tp, "num_kv_heads", replicate=True)
                    common = dict(block_size=block_size, num_kv_heads=kv_heads,
                                  head_size=mixer.head_dim, dtype=kv_dtype)
                    if mixer.sliding_window is not None and mixer.sliding_window < limit:
                        specs[name] = SlidingWindowSpec(sliding_window=mixer.sliding_window, **common)
                    elif mixer.attention_chunk_size is not None and mixer.attention_chunk_size < limit:
                        specs[name] = ChunkedLocalAttentionSpec(
                            attention_chunk_size=mixer.attention_chunk_size, **common)
                    else:
                        specs[name] = FullAttentionSpec(**common)
                else:                   # a conv state, then (Mamba) the SSM state
                    shapes = mixer.state_shapes(tp)
                    specs[name] = MambaSpec(block_size=block_size, shapes=shapes,
                                            dtypes=(conv_dtype, torch.float32)[:len(shapes)])
            except ValueError as err:
                raise ValueError(f"{name} ({type(mixer).__name__}): {err}") from None
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
        types = {t.__name__: t for t in (Rope, Attention, Mamba2, Mamba1, ShortConv, GatedDeltaNet,
                                         KimiDeltaAttention, MultiLatentAttention, MLP, MoE, DenseMoE, AltUp,
                                         SharedBlock, Layer, HybridConfig)}

        def decode(obj: Any, where: str) -> Any:
            if isinstance(obj, dict) and "type" in obj:
                kind = obj["type"]
                if kind not in types:
                    raise ValueError(f"{where}: unknown config type {kind!r} (known: {sorted(types)})")
                fields = {k: decode(v, f"{where}.{k}") for k, v in obj.items() if k != "type"}
                try:
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

"""Mixer kinds: everything the rest of hybridkv asks of one kind of token mixer, declared once, by the kind.

A kind is its config: a frozen, keyword-only dataclass deriving from ``MixerConfig``, defined in its layer module
next to the module it builds (``layers/mamba2.py``: ``Mamba2`` and ``Mamba2Layer``) and registered there with
``register_mixer``. Its hooks:

- ``cache_spec(ctx)``: its per-request cache (``kv_groups.specs``): an attention spec, a recurrent state
  (``RecurrentMixerConfig``: ``state_shapes``, conv dtype then fp32) or None;
- ``check_tensor_parallel(tp)``: a ``ValueError`` naming the dimension ``tp`` ranks cannot split;
- ``matrix_elements(hidden, width)``: elements of its projection matrices (the cheap lower bound of
  ``models/memory.py``);
- ``build(hidden_size, cache_name=, tp=, model_config=)``: its ``nn.Module``;
- ``init_parameter(name, shape, gen)``: a random init of its own for one of its parameters, or None for the model's
  (matrices N(0, 0.02), norms at identity, biases 0);
- ``ops``: the backend ops its module calls, each registered with its reference twin as the default of the open op
  table (``layers/ops/registry.py``) that kernel backends override.

The registry is keyed by class name, the name ``HybridConfig.to_dict`` writes: ``HybridConfig.from_dict``, the KV-cache
plan, the tensor-parallel check, the memory check and the model builder go through it, never through a list of
kinds. ``models/config.py`` imports every built-in kind (which registers it) and re-exports its config class.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hybridkv.kv_groups.specs import KVCacheSpec, MambaSpec

if TYPE_CHECKING:
    from torch import nn

    from hybridkv.layers.parallel import TensorParallel
    from hybridkv.models.config import HybridConfig


@dataclass(frozen=True, kw_only=True)
class CacheContext:
    """What a mixer's cache spec depends on besides its own config (``HybridConfig.kv_specs``)."""

    block_size: int
    kv_dtype: torch.dtype
    conv_dtype: torch.dtype             # conv states (Mamba's, ShortConv's, the delta rules')
    tensor_parallel_size: int
    max_positions: int                  # a window or chunk at least this long behaves as full attention
    layer_cache: Callable[[int], tuple[str, KVCacheSpec]]   # an earlier layer's (cache name, spec): KV sharing


class MixerConfig(abc.ABC):
    """The base of every mixer kind's config (see the module docstring). ``ops``: the backend ops its module calls."""

    ops: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def cache_spec(self, ctx: CacheContext) -> KVCacheSpec | None:
        """This mixer's per-request cache on one tensor-parallel rank, or None if it keeps none."""

    @abc.abstractmethod
    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` naming the dimension ``tensor_parallel_size`` ranks cannot split."""

    @abc.abstractmethod
    def matrix_elements(self, hidden: int, width: int) -> int:
        """Elements of its projection matrices (``width``: its input width; ``hidden``: the model's)."""

    @abc.abstractmethod
    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> nn.Module:
        """Its module (this rank's shard), reading ``hidden_size`` wide input, owning the cache ``cache_name``."""

    def init_parameter(self, name: str, shape: tuple[int, ...],
                       gen: torch.Generator) -> torch.Tensor | float | None:
        """The random init of its parameter ``name`` (relative to its module) of full ``shape``: a full tensor drawn
        from ``gen`` on ``gen.device``, a value to fill, or None for the model's rule."""
        return None

    @classmethod
    def saved_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields of a config saved by an earlier hybridkv (``HybridConfig.from_dict``) as this one takes them:
        a kind that dropped or renamed a field maps it here, or raises ``ValueError`` saying what to do."""
        return fields


class RecurrentMixerConfig(MixerConfig):
    """A mixer whose per-request cache is a fixed-size state (``MambaSpec``): its conv state, then (if any) its
    recurrent state in fp32."""

    @abc.abstractmethod
    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """Its state tensors' shapes (no batch dim) on one tensor-parallel rank: conv state first."""

    def cache_spec(self, ctx: CacheContext) -> KVCacheSpec:
        shapes = self.state_shapes(ctx.tensor_parallel_size)
        return MambaSpec(block_size=ctx.block_size, shapes=shapes,
                         dtypes=(ctx.conv_dtype, torch.float32)[:len(shapes)])


def ssm_parameter_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | float | None:
    """Mamba's init of the decay parameters (Mamba2, Mamba-1, and the delta rules that share their names): ``A_log``
    log(1..16) along its last dim, ``dt_bias`` softplus^-1 of a dt log-uniform in [1e-3, 0.1], ``D`` 1."""
    leaf = name.rpartition(".")[2]
    if leaf == "A_log":
        return torch.log(torch.linspace(1, 16, shape[-1], device=gen.device)).expand(shape)
    if leaf == "dt_bias":
        u = torch.rand(shape, generator=gen, device=gen.device)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))
    return 1.0 if leaf == "D" else None


class DecayMixerConfig(RecurrentMixerConfig):
    """A recurrent kind with Mamba's decay parameters (``A_log``, ``dt_bias``, ``D`` where it has them), initialised
    as Mamba does (``ssm_parameter_init``): Mamba2, Mamba-1 and the delta rules."""

    def init_parameter(self, name: str, shape: tuple[int, ...],
                       gen: torch.Generator) -> torch.Tensor | float | None:
        return ssm_parameter_init(name, shape, gen)


# The hooks every kind has (``init_parameter`` and ``saved_fields`` have defaults); the registry refuses a kind
# missing one.
MIXER_HOOKS = ("cache_spec", "check_tensor_parallel", "matrix_elements", "build", "init_parameter", "saved_fields")

_KINDS: dict[str, type[MixerConfig]] = {}


def register_mixer(cls: type[MixerConfig]) -> type[MixerConfig]:
    """Class decorator: register the mixer kind ``cls`` under its class name (the name ``to_dict`` writes)."""
    if not (isinstance(cls, type) and issubclass(cls, MixerConfig)):
        raise TypeError(f"register_mixer: {cls!r} is not a MixerConfig subclass")
    if getattr(cls, "__abstractmethods__", None):
        raise TypeError(f"register_mixer: {cls.__name__} leaves hooks unimplemented: "
                        f"{sorted(cls.__abstractmethods__)}")
    known = _KINDS.get(cls.__name__)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"register_mixer: a mixer kind named {cls.__name__} is already registered "
                         f"({known.__module__})")
    _KINDS[cls.__name__] = cls
    return cls


def mixer_kinds() -> Mapping[str, type[MixerConfig]]:
    """Class name -> config class of every registered mixer kind, by name."""
    return {name: _KINDS[name] for name in sorted(_KINDS)}

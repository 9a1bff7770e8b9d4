"""safetensors (hub weight names) -> ``HybridModel`` parameters, for every family through one loop.

A family only says where each hub tensor goes: a ``WeightMap`` turns a hub name into ``Target``s (our
parameter name, an optional sub-tensor index such as an expert, an optional transform such as a slice
of a fused tensor). ``load_weights`` does the rest the same way for all: it streams one tensor at a
time (``safe_open``; never a second copy of the model in memory), converts it to the parameter's dtype
and device, checks shapes, and counts coverage so that a missing, unexpected or doubly written
tensor is an error naming it — never a silently random parameter.

Tensor parallelism is one more step here, not in the maps: a target's transform yields the *full*
(sub-)tensor, and ``HybridModel.shard_of`` cuts this rank's part before the shape check and the copy, so
each rank keeps only its shard (peak: one full hub tensor at a time).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hybridkv.models.config import HybridConfig
from hybridkv.models.hybrid import HybridModel

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"

_LIST_LIMIT = 12     # names shown per error list


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where (part of) one hub tensor goes: ``param[index] = transform(hub_tensor)``.

    ``index`` selects a sub-tensor along the leading dims (e.g. ``(expert,)`` of a stacked expert
    weight); ``transform`` reshapes the hub tensor into that sub-tensor's layout (transpose, slice of
    a fused tensor, ...). Arithmetic in a transform runs in the checkpoint's dtype."""

    name: str
    index: tuple[int, ...] = ()
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


# hub tensor name -> targets; [] = a known tensor deliberately ignored (e.g. rotary inv_freq);
# None = a tensor the family does not know (an error: the checkpoint is not what we think it is).
WeightMap = Callable[[str, HybridConfig], "list[Target] | None"]

WEIGHT_MAPS: dict[str, WeightMap] = {}


def register_weight_map(*architectures: str) -> Callable[[WeightMap], WeightMap]:
    """Register the decorated function as the hub weight map of ``architectures`` (HF names)."""

    def wrap(fn: WeightMap) -> WeightMap:
        for name in architectures:
            if name in WEIGHT_MAPS and WEIGHT_MAPS[name] is not fn:
                raise ValueError(f"a weight map for {name} is already registered "
                                 f"({WEIGHT_MAPS[name].__module__}.{WEIGHT_MAPS[name].__name__})")
            WEIGHT_MAPS[name] = fn
        return fn

    return wrap


def supported_weight_architectures() -> tuple[str, ...]:
    import hybridkv.loaders.families  # noqa: F401  (registration happens on import)

    return tuple(sorted(WEIGHT_MAPS))


def get_weight_map(architecture: str) -> WeightMap:
    """The registered weight map of ``architecture``; unknown ones name every supported one."""
    supported = supported_weight_architectures()
    if architecture not in WEIGHT_MAPS:
        raise ValueError(f"no weight loader for architecture {architecture!r}; supported: "
                         f"{', '.join(supported)}")
    return WEIGHT_MAPS[architecture]


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, else ``model.safetensors``."""
    directory = Path(checkpoint_dir)
    index = directory / SAFETENSORS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({err})") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that do not exist: {', '.join(absent)}")
        return files
    single = directory / SAFETENSORS_NAME
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory}: no {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME} "
                            f"(only safetensors checkpoints are supported)")


# -- helpers for weight maps ---------------------------------------------------------------------------
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def split_layer(name: str) -> tuple[int, str] | None:
    """``"layers.3.self_attn.q_proj.weight"`` -> ``(3, "self_attn.q_proj.weight")``; None otherwise."""
    match = _LAYER.fullmatch(name)
    return (int(match[1]), match[2]) if match else None


def rename_module(name: str, modules: Mapping[str, str], *, prefix: str = "") -> list[Target] | None:
    """One target for ``<module>.<weight|bias>`` whose module path ``modules`` renames (the parameter
    suffix is kept, so biases follow their weights); None when the module is not in the table."""
    module, dot, leaf = name.rpartition(".")
    if not dot or module not in modules:
        return None
    return [Target(name=f"{prefix}{modules[module]}.{leaf}")]


def _show(names: list[str]) -> str:
    more = f" ... (+{len(names) - _LIST_LIMIT} more)" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


def _overlaps(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Integer index tuples name nested sub-tensors: two overlap iff one is a prefix of the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def load_weights(model: HybridModel, checkpoint_dir: str | Path, weight_map: WeightMap, *,
                 config: HybridConfig) -> None:
    """Fill every parameter of ``model`` from the hub-named safetensors in ``checkpoint_dir``.

    Raises ``ValueError`` naming the hub tensor and target on a shape mismatch, a target that is not a
    parameter, or a sub-tensor written twice; and, after the pass, naming every parameter not fully
    written and every hub tensor the map does not know. A tied parameter's alias (``lm_head.weight``
    when embeddings are tied) is filled through its owner, so writes to the alias are skipped."""
    params = dict(model.named_parameters())
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    filled: dict[str, list[tuple[int, ...]]] = {name: [] for name in params}
    counts = dict.fromkeys(params, 0)
    unexpected: list[str] = []
    for file in checkpoint_files(checkpoint_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for hub_name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                targets = weight_map(hub_name, config)
                if targets is None:
                    unexpected.append(hub_name)
                    continue
                if not targets:
                    continue
                tensor = handle.get_tensor(hub_name)
                for target in targets:
                    _fill(model, params, aliases, filled, counts, hub_name, tensor, target)
                del tensor
    missing = [f"{name} ({counts[name]}/{p.numel()} elements)" if counts[name] else name
               for name, p in params.items() if counts[name] != p.numel()]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameters not in the checkpoint: {_show(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected checkpoint tensors: {_show(sorted(unexpected))}")
        raise ValueError(f"{config.architecture} checkpoint {checkpoint_dir}: " + "; ".join(parts))


def _fill(model: HybridModel, params: dict[str, torch.nn.Parameter], aliases: set[str],
          filled: dict[str, list[tuple[int, ...]]], counts: dict[str, int], hub_name: str, tensor: torch.Tensor,
          target: Target) -> None:
    where = f"{target.name}{list(target.index) if target.index else ''}"
    if target.name in aliases:
        return
    if target.name not in params:
        raise ValueError(f"checkpoint tensor {hub_name} maps to {target.name}, which is not a parameter of "
                         f"the model (a weight-map bug or a config/checkpoint mismatch)")
    for done in filled[target.name]:
        if _overlaps(done, target.index):
            raise ValueError(f"checkpoint tensor {hub_name} writes {where}, which an earlier tensor "
                             f"already wrote (at index {list(done)})")
    param = params[target.name]
    try:
        dest = param.data[target.index] if target.index else param.data
    except IndexError:
        raise ValueError(f"checkpoint tensor {hub_name}: index {list(target.index)} is out of range for "
                         f"{target.name} of shape {tuple(param.shape)}") from None
    value = target.transform(tensor) if target.transform is not None else tensor
    try:
        value = model.shard_of(target.name, value, offset=len(target.index))    # this rank's part
    except ValueError as err:
        raise ValueError(f"checkpoint tensor {hub_name} -> {where}: {err}") from None
    if tuple(value.shape) != tuple(dest.shape):
        raise ValueError(f"checkpoint tensor {hub_name} has shape {tuple(tensor.shape)}"
                         f"{f' (transformed: {tuple(value.shape)})' if value is not tensor else ''}; "
                         f"{where} expects {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(value)            # converts to the parameter's dtype and device
    filled[target.name].append(target.index)
    counts[target.name] += dest.numel()

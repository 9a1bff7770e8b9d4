"""safetensors (hub weight names) -> ``HybridModel`` parameters, for every family through one loop.

A family only says where each hub tensor goes: a ``WeightMap`` turns a hub name into ``Target``s (our
parameter name, an optional sub-tensor index such as an expert, an optional transform such as a slice
of a fused tensor). ``load_weights`` does the rest the same way for all, in two passes:

1. ``check_weights``, before a byte of tensor data is read (and before the model is allocated, when run on
   its meta twin): every file's header is checked (``read_header``: a truncated or corrupt file is one error
   naming it), and every hub tensor runs through its targets as a meta tensor of the header's shape, so a
   shape mismatch, a target that is not a parameter, a doubly written sub-tensor, a parameter left
   unwritten or a tensor the map does not know is an error naming it;
2. the stream: one tensor at a time (never a second copy of the model in memory), converted to the
   parameter's dtype and device; a parameter that then holds NaN or inf is an error naming the hub tensor.

Which files: ``model.safetensors``, or the shards ``model.safetensors.index.json`` names; a shard must be a
file inside the checkpoint directory (no absolute paths, no ``..``, no symlink leading out of it, except
into the blob store of a Hugging Face cache snapshot).

A target may need other hub tensors too (``Target.inputs``: MXFP4 blocks need their scales); the loader reads
them from whichever file holds them and passes them to the transform after the target's own tensor.

Tensor parallelism is one more step here, not in the maps: a target's transform yields the *full*
(sub-)tensor, and ``HybridModel.shard_of`` cuts this rank's part before the shape check and the copy, so
each rank keeps only its shard (peak: one full hub tensor at a time).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from hybridkv.models.config import HybridConfig
from hybridkv.models.hybrid import HybridModel, copy_finite, overflow_note
from hybridkv.models.safetensors_file import CheckpointError, TensorInfo, TensorReader, read_header

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"

_LIST_LIMIT = 12     # names shown per error list


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where (part of) one hub tensor goes: ``param[index] = transform(hub_tensor)``.

    ``index`` selects a sub-tensor along the leading dims (e.g. ``(expert,)`` of a stacked expert
    weight); ``transform`` reshapes the hub tensor into that sub-tensor's layout (transpose, slice of
    a fused tensor, ...). Arithmetic in a transform runs in the checkpoint's dtype. ``inputs``: names of
    other hub tensors the transform also takes, in order after the hub tensor (``transform(t, *inputs)``);
    while checking, every tensor a transform sees is a meta tensor of the header's shape."""

    name: str
    index: tuple[int, ...] = ()
    transform: Callable[..., torch.Tensor] | None = None
    inputs: tuple[str, ...] = ()


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


def _allowed_roots(directory: Path) -> list[Path]:
    """Where a checkpoint's files may resolve to: its directory, and for a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``, whose files are symlinks to ``<repo>/blobs/``) that repo's blobs."""
    roots = [directory]
    if directory.parent.name == "snapshots" and (directory.parent.parent / "blobs").is_dir():
        roots.append((directory.parent.parent / "blobs").resolve())
    return roots


def _inside(path: Path, directory: Path, where: Path, name: str) -> Path:
    """``path`` (a file the checkpoint names) if it resolves inside the checkpoint ``directory``."""
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(directory)):
        raise CheckpointError(f"{where}: {name!r} resolves to {resolved}, outside the checkpoint directory "
                              f"{directory} (a symlink leading out of it)")
    if not resolved.is_file():
        raise FileNotFoundError(f"{where} names {name!r}, which does not exist in {directory}")
    return path


def _shard_name(index: Path, name: object) -> str:
    """A shard name from the index: a plain relative path that stays inside the directory."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: shard name {name!r} is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or Path(name).is_absolute():
        raise CheckpointError(f"{index}: shard {name!r} is an absolute path; an index may only name files "
                              f"inside the checkpoint directory")
    if ".." in pure.parts:
        raise CheckpointError(f"{index}: shard {name!r} leads out of the checkpoint directory ('..')")
    if "\\" in name or "\0" in name:
        raise CheckpointError(f"{index}: shard {name!r} is not a plain relative file name")
    return name


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, else ``model.safetensors``; each a
    file inside the checkpoint directory."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    root = directory.resolve()
    index = directory / SAFETENSORS_INDEX_NAME
    if index.is_file():
        _inside(index, root, index, SAFETENSORS_INDEX_NAME)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
        names = [_shard_name(index, name) for name in names]
        return [_inside(directory / name, root, index, name) for name in names]
    single = directory / SAFETENSORS_NAME
    if single.exists():
        return [_inside(single, root, directory, SAFETENSORS_NAME)]
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


class _Coverage:
    """What the targets of a checkpoint write into ``model``'s parameters: each write is checked (the target is
    a parameter, the index is in range, the shapes agree after the transform and this rank's cut, no sub-tensor
    is written twice) and counted, so that a parameter left partly unwritten is found at the end."""

    def __init__(self, model: HybridModel) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        # A tied parameter's alias (lm_head.weight when embeddings are tied) is filled through its owner.
        self.aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(self.params)
        self.filled: dict[str, list[tuple[int, ...]]] = {name: [] for name in self.params}
        self.counts = dict.fromkeys(self.params, 0)
        self.unexpected: list[str] = []

    def write(self, file: Path, hub_name: str, tensor: torch.Tensor, target: Target, *, copy: bool,
              inputs: tuple[torch.Tensor, ...] = ()) -> None:
        """Check (and with ``copy``, perform) ``param[target.index] = transform(tensor, *inputs)``; the tensors may
        be meta tensors when only checking."""
        where = f"{target.name}{list(target.index) if target.index else ''}"
        if target.name in self.aliases:
            return
        if target.name not in self.params:
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name} maps to {target.name}, which is not a "
                             f"parameter of the model (a weight-map bug or a config/checkpoint mismatch)")
        for done in self.filled[target.name]:
            if _overlaps(done, target.index):
                raise ValueError(f"{file.name}: checkpoint tensor {hub_name} writes {where}, which an earlier "
                                 f"tensor already wrote (at index {list(done)})")
        param = self.params[target.name]
        full = param.data if copy else torch.empty(param.shape, dtype=param.dtype, device="meta")
        try:
            dest = full[target.index] if target.index else full
        except IndexError:
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name}: index {list(target.index)} is out of "
                             f"range for {target.name} of shape {tuple(param.shape)}") from None
        try:
            value = target.transform(tensor, *inputs) if target.transform is not None else tensor
        except ValueError as err:
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name} -> {where}: {err}") from None
        try:
            value = self.model.shard_of(target.name, value, offset=len(target.index))    # this rank's part
        except ValueError as err:
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name} -> {where}: {err}") from None
        if tuple(value.shape) != tuple(dest.shape):
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name} has shape {tuple(tensor.shape)}"
                             f"{f' (transformed: {tuple(value.shape)})' if value is not tensor else ''}; "
                             f"{where} expects {tuple(dest.shape)}")
        if copy and not copy_finite(dest, value):      # converts to the parameter's dtype and device
            raise ValueError(f"{file}: checkpoint tensor {hub_name} holds NaN or inf{overflow_note(value, dest)} "
                             f"(loading {where})")
        self.filled[target.name].append(target.index)
        self.counts[target.name] += dest.numel()

    def check_complete(self, config: HybridConfig, checkpoint_dir: str | Path) -> None:
        missing = [f"{name} ({self.counts[name]}/{p.numel()} elements)" if self.counts[name] else name
                   for name, p in self.params.items() if self.counts[name] != p.numel()]
        if missing or self.unexpected:
            parts = []
            if missing:
                parts.append(f"{len(missing)} parameters not in the checkpoint: {_show(missing)}")
            if self.unexpected:
                parts.append(f"{len(self.unexpected)} unexpected checkpoint tensors: {_show(sorted(self.unexpected))}")
            raise ValueError(f"{config.architecture} checkpoint {checkpoint_dir}: " + "; ".join(parts))


def _headers(checkpoint_dir: str | Path) -> dict[Path, dict[str, TensorInfo]]:
    return {file: read_header(file) for file in checkpoint_files(checkpoint_dir)}


def check_weights(model: HybridModel, checkpoint_dir: str | Path, weight_map: WeightMap, *,
                  config: HybridConfig) -> None:
    """Everything ``load_weights`` checks that does not need tensor data, from the files' headers alone:
    ``model`` may be on the meta device (nothing is allocated or read). Raises ``CheckpointError`` naming the
    file for a corrupt or truncated file or a shard outside the checkpoint, ``ValueError`` naming the hub tensor
    and target on a shape mismatch, a target that is not a parameter or a sub-tensor written twice, and naming
    every parameter not fully written and every hub tensor the map does not know."""
    _check(model, _headers(checkpoint_dir), weight_map, config=config, checkpoint_dir=checkpoint_dir)


def _where_is(headers: dict[Path, dict[str, TensorInfo]]) -> dict[str, tuple[Path, TensorInfo]]:
    """Hub tensor name -> (its file, its header entry), over every file of the checkpoint."""
    return {name: (file, info) for file, header in headers.items() for name, info in header.items()}


def _input_files(file: Path, hub_name: str, target: Target, where: dict[str, tuple[Path, TensorInfo]]
                 ) -> list[tuple[str, Path, TensorInfo]]:
    """(name, file, header entry) of each of ``target.inputs``; one the checkpoint lacks is an error."""
    out = []
    for name in target.inputs:
        if name not in where:
            raise ValueError(f"{file.name}: checkpoint tensor {hub_name} (-> {target.name}) needs {name}, which the "
                             f"checkpoint does not have")
        out.append((name, *where[name]))
    return out


def _check(model: HybridModel, headers: dict[Path, dict[str, TensorInfo]], weight_map: WeightMap, *,
           config: HybridConfig, checkpoint_dir: str | Path) -> None:
    coverage = _Coverage(model)
    where = _where_is(headers)
    for file, header in headers.items():
        for hub_name, info in header.items():
            targets = weight_map(hub_name, config)
            if targets is None:
                coverage.unexpected.append(hub_name)
                continue
            tensor = torch.empty(info.shape, dtype=info.dtype, device="meta")
            for target in targets:
                inputs = tuple(torch.empty(i.shape, dtype=i.dtype, device="meta")
                               for _, _, i in _input_files(file, hub_name, target, where))
                coverage.write(file, hub_name, tensor, target, copy=False, inputs=inputs)
    coverage.check_complete(config, checkpoint_dir)


def load_weights(model: HybridModel, checkpoint_dir: str | Path, weight_map: WeightMap, *,
                 config: HybridConfig) -> None:
    """Fill every parameter of ``model`` from the hub-named safetensors in ``checkpoint_dir``: first
    ``check_weights`` (its errors, before any data is read), then tensors stream in one at a time, in file
    order; a parameter that holds NaN or inf once written is an error naming the hub tensor (and the dtype
    it overflowed, when the checkpoint's value was finite). A tied parameter's alias (``lm_head.weight``
    when embeddings are tied) is filled through its owner, so writes to the alias are skipped."""
    headers = _headers(checkpoint_dir)
    _check(model, headers, weight_map, config=config, checkpoint_dir=checkpoint_dir)
    coverage = _Coverage(model)
    where = _where_is(headers)
    with contextlib.ExitStack() as stack:
        readers: dict[Path, TensorReader] = {}

        def reader_of(file: Path) -> TensorReader:
            if file not in readers:
                readers[file] = stack.enter_context(TensorReader(file))
            return readers[file]

        for file, header in headers.items():
            for hub_name in header:
                targets = weight_map(hub_name, config)
                if not targets:
                    continue
                tensor = reader_of(file).get(hub_name)
                extra: dict[str, torch.Tensor] = {}      # read once for all of this tensor's targets
                for target in targets:
                    for name, in_file, _ in _input_files(file, hub_name, target, where):
                        if name not in extra:
                            extra[name] = reader_of(in_file).get(name)
                    coverage.write(file, hub_name, tensor, target, copy=True,
                                   inputs=tuple(extra[name] for name in target.inputs))
                del tensor, extra
    coverage.check_complete(config, checkpoint_dir)

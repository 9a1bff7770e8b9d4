"""safetensors files read defensively: the header is checked against the file before any tensor is read.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape,
``data_offsets`` into the data that follows), then the data. ``read_header`` checks all of it the way the
format demands (known dtypes, offsets that tile the data exactly, byte counts that match the shapes, a file
as long as the header says), so a truncated, garbled or hand-edited file is one ``CheckpointError`` naming the
file and what is wrong, and the shapes and dtypes are known before the model is built. ``TensorReader`` then
reads tensors by name, each read error naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# The format's dtypes that torch can hold (sub-byte float formats are not loadable here).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100_000_000       # the safetensors library's own limit


class CheckpointError(ValueError):
    """A checkpoint file or directory that is not what it claims to be; the message is one line naming it."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype, shape, and the byte range ``[start, end)`` of its data in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _entry(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r} {what} (corrupt or not a safetensors file)")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad("has no dtype, shape and data_offsets")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, which is not supported "
                              f"(supported: {', '.join(DTYPES)})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has invalid data_offsets {offsets!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes) for shape {shape} of "
                  f"{entry['dtype']} ({nbytes} bytes)")
    if offsets[1] > data_len:
        raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {offsets[1]} of the data, the "
                              f"file holds {data_len} data bytes")
    return TensorInfo(dtype=dtype, shape=tuple(shape), start=offsets[0], end=offsets[1])


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> ``TensorInfo`` of the safetensors file ``path``, in data order; raises
    ``CheckpointError`` naming the file if the file is not a complete, consistent safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file, or truncated (its first 8 bytes announce "
                                      f"a {header_len}-byte header; the file has {size} bytes)")
            raw = f.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    infos = {name: _entry(path, name, entry, data_len) for name, entry in header.items()}
    ordered = sorted(infos.items(), key=lambda item: (item[1].start, item[1].end))
    end = 0
    for name, info in ordered:                 # the format: tensors tile the data, no gap, no overlap
        if info.start != end:
            what = "overlaps the tensor before it" if info.start < end else f"leaves a gap at byte {end}"
            raise CheckpointError(f"{path}: tensor {name!r} (data_offsets [{info.start}, {info.end}]) {what} "
                                  f"(corrupt safetensors file)")
        end = info.end
    if end != data_len:
        raise CheckpointError(f"{path}: {data_len - end} bytes after the last tensor's data (corrupt "
                              f"safetensors file)")
    return dict(ordered)


class TensorReader:
    """Read tensors of one (header-checked) safetensors file by name, on the CPU; a context manager. Errors
    (the file changed or went away since ``read_header``) name the file and the tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle = None

    def __enter__(self) -> TensorReader:
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu").__enter__()
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self.path}: cannot open: {err}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.__exit__(*exc)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r}: {err}") from None

"""What every kernel backend is: the open op table (``KernelBackend``: the reference twins registered under
``layers/ops/``, with a backend's kernels in place of the ops it has), the error a kernel raises for a configuration
it cannot run (``UnsupportedConfig``) and the complete reference backend (``torch_backend``).

The bottom of ``backends/``: the Triton and vendor modules build on it, and ``registry`` (which names and
composes backends) imports them, so imports only point down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hybridkv.layers.ops import reference_ops

__all__ = ["KernelBackend", "UnsupportedConfig", "torch_backend"]


class UnsupportedConfig(ValueError):
    """A vendor kernel cannot run this call's configuration (block size, dtype, head dim, device ...).

    Raised by a vendor op before it changes anything, so ``auto`` can run the replaced op instead."""

    def __init__(self, backend: str, op: str, constraint: str) -> None:
        self.backend, self.op, self.constraint = backend, op, constraint
        super().__init__(f"kernel backend {backend!r} cannot run {op}: {constraint} "
                         f"(backend='auto' falls back to the next backend for such calls)")


@dataclass(frozen=True, init=False, eq=False, repr=False)
class KernelBackend:
    """One implementation of every op a layer calls: the open op table (``layers/ops/registry.py``: each op's
    reference twin, its signature) with ``overrides``, the ops this backend has kernels for, in their place. An op is
    an attribute (``backend.paged_attention(...)``); one this backend does not override, or one registered after it
    was made, is the reference.

    Made with the ops it has kernels for, ``KernelBackend(name="triton", paged_attention=...)``, or from another by
    ``dataclasses.replace(backend, name=..., write_kv=...)``; an unknown op name is a ``TypeError``.
    ``cuda_graph_safe``: its decode-path ops read only device metadata and never sync, so a captured
    decode step stays correct for any batch of the captured size (``engine/cuda_graphs.py``). The mixed-step graphs
    also capture its attention and Mamba2's packed conv and scan (``engine/mixed_metadata.py``); where that scan
    refuses a capture (mamba_ssm's), the Mamba2 layers break the graph instead (``ModelRunner._capture_mixed``)."""

    name: str
    overrides: Mapping[str, Callable[..., Any]]
    cuda_graph_safe: bool = False

    def __init__(self, *, name: str, overrides: Mapping[str, Callable[..., Any]] | None = None,
                 cuda_graph_safe: bool = False, **ops: Callable[..., Any]) -> None:
        references = reference_ops()
        ops = {**(overrides or {}), **ops}
        unknown = sorted(ops.keys() - references.keys())
        if unknown:
            raise TypeError(f"kernel backend {name!r}: unknown op(s) {', '.join(unknown)} (the registered ops: "
                            f"{', '.join(sorted(references))})")
        own = {op: fn for op, fn in ops.items() if fn is not references[op]}
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "overrides", MappingProxyType(own))
        object.__setattr__(self, "cuda_graph_safe", cuda_graph_safe)
        for op, reference in references.items():    # plain attributes: an op costs a field's lookup on the hot path
            object.__setattr__(self, op, own.get(op, reference))

    def __getattr__(self, op: str) -> Callable[..., Any]:
        """Only reached for an op registered after this backend was made (its reference), or for no op at all."""
        reference = reference_ops().get(op)
        if reference is None:
            raise AttributeError(f"kernel backend {self.__dict__.get('name')!r} has no op {op!r}")
        return reference

    def ops(self) -> dict[str, Callable[..., Any]]:
        """Op name -> what this backend runs for it, for every registered op."""
        return {op: getattr(self, op) for op in reference_ops()}

    def _key(self) -> tuple[Any, ...]:
        return self.name, self.cuda_graph_safe, frozenset(self.overrides.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelBackend) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"KernelBackend(name={self.name!r}, overrides=[{', '.join(self.overrides)}], "
                f"cuda_graph_safe={self.cuda_graph_safe})")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.name, dict(self.overrides), self.cuda_graph_safe)


def _rebuild(name: str, overrides: dict[str, Callable[..., Any]], cuda_graph_safe: bool) -> KernelBackend:
    return KernelBackend(name=name, overrides=overrides, cuda_graph_safe=cuda_graph_safe)


def torch_backend() -> KernelBackend:
    """The reference ops: complete, any device. Other backends replace the ops they have kernels for."""
    return KernelBackend(name="torch")

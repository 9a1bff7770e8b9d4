"""The open op table: every op a layer calls through its kernel backend, with its pure-torch reference twin as the
default.

Each reference module registers the ops it defines (``@reference_op("ssd_chunk_scan")``); a kernel backend
(``backends/base.py``'s ``KernelBackend``) is this table with the ops it has kernels for replaced, so a backend
without an op runs its reference. A new op is a ``*_ref`` function under ``layers/ops/`` with this decorator (and
an import in ``layers/ops/__init__.py``, which loads every reference module); backends override it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_REFERENCES: dict[str, Callable[..., Any]] = {}


def reference_op(name: str) -> Callable[[F], F]:
    """Register the decorated function as the reference twin (the default) of the backend op ``name``."""

    def register(fn: F) -> F:
        known = _REFERENCES.get(name)
        if known is not None and _where(known) != _where(fn):       # the same function again: a module reload
            raise ValueError(f"backend op {name!r} already has the reference {'.'.join(_where(known))}")
        _REFERENCES[name] = fn
        return fn

    return register


def _where(fn: Callable[..., Any]) -> tuple[str, str]:
    return fn.__module__, fn.__qualname__


def reference_ops() -> Mapping[str, Callable[..., Any]]:
    """Op name -> its reference, for every registered op (a read-only view: later registrations show in it)."""
    return MappingProxyType(_REFERENCES)

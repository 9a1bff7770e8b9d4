"""The base of every config dataclass: each field conformed to its annotation, and the common value checks.

Configs (``models/config.py``, and each mixer kind's in its layer module) are frozen, keyword-only dataclasses whose
``__post_init__`` first calls ``check_fields``: JSON's lists become tuples, ints become floats where a float is
expected, and a value of the wrong type is a ``ValueError`` naming the field, before any value check runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any

# Sanity bound on any int field: far beyond any released model, low enough that a config.json typo
# (hidden_size=10**9) is an error before anything is built; sizes are int32 on the device (kernel indices, offsets).
MAX_DIM = 2**31 - 1


def positive(owner: str, **values: float | int | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(hint: Any) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def conform(value: Any, hint: Any, where: str, *, in_tuple: bool = False) -> Any:
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
                return conform(value, option, where, in_tuple=in_tuple)
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
        return tuple(conform(v, a, f"{where}[{i}]", in_tuple=True)
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


def check_fields(obj: Any) -> None:
    """Conform every field of the frozen dataclass ``obj`` to its annotation (see ``conform``); the first
    thing each config class's ``__post_init__`` does, so the value checks after it see the right types."""
    owner = type(obj).__name__
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        conformed = conform(value, hint, f"{owner}.{name}")
        if conformed is not value:
            object.__setattr__(obj, name, conformed)

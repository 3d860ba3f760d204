"""Strict decoding of JSON objects into frozen message dataclasses.

The protocol must import only the standard library (the server, the agent and
the aggregator all share it), so this is a small checker for the handful of
field types messages use: int, float, str, bool, ``X | None``, ``list[X]``,
``dict[str, X]`` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import cache
from typing import Any, Literal, TypeVar, get_args, get_origin

from .errors import ProtocolError

T = TypeVar("T")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in get_args(hint):
            raise ProtocolError(f"{where}: expected one of {list(get_args(hint))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {args}")
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(hint)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = get_args(hint)
        return {str(k): _check(v, item, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r} in a protocol dataclass")


def from_dict(cls: type[T], data: Any, where: str | None = None) -> T:
    """Build dataclass ``cls`` from a decoded JSON object, checking every field.

    Unknown keys are rejected so that a typo on either side fails loudly
    instead of being ignored.

    Raises:
        ProtocolError: naming the first field that is missing, unknown or of the wrong type.
    """
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ProtocolError(f"{where}: unknown field {unknown[0]!r}")
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _check(data[name], hints[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}: missing field {name!r}")
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON-ready form of a message dataclass."""
    return dataclasses.asdict(obj)

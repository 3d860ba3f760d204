"""JSON request bodies checked by msgspec types, with refusals that name the field in our own words."""

from __future__ import annotations

import re
from typing import Any, TypeVar, overload

import msgspec

from crowdtrain.lib.text import not_text

T = TypeVar("T")

# msgspec's messages end with where the problem is: " - at `$.size`", " - at `key` in `$`".
_WHERE = re.compile(r" - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
_WRONG_TYPE = re.compile(r"Expected `(?P<wanted>[^`]+)`, got `(?P<got>[^`]+)`")
_CONSTRAINED = re.compile(r"Expected `(?P<wanted>[^`]+)` (?P<rule>.+)")
_WORDS = {
    "int": "an integer",
    "str": "a string",
    "float": "a number",
    "bool": "a boolean",
    "object": "a JSON object",
    "array": "a JSON array",
}


class BodyError(ValueError):
    """A body that does not fit its type; the message names the field and says what it must be."""


@overload
def convert(data: Any, kind: type[T], *, field: str = "") -> T: ...


@overload
def convert(data: Any, kind: Any, *, field: str = "") -> Any: ...


def convert(data: Any, kind: Any, *, field: str = "") -> Any:
    """``data`` (decoded JSON, or a form's dict of strings) as ``kind``, checked by msgspec.

    Every string and key is checked to be text first (JSON may carry lone surrogates, which no encoder takes).

    Args:
        data: the decoded body, or a part of it.
        kind: a msgspec Struct, or a type such as ``dict[str, int]`` with ``Meta`` constraints.
        field: the name ``data`` has in the body, to prefix the names in messages ("hardware").

    Raises:
        BodyError: ``size is required``, ``size must be an integer, got '12'``, ...
    """
    # Before msgspec, which fails on them with a UnicodeEncodeError rather than a ValidationError.
    bad = next(not_text(data), None)
    if bad is not None:
        raise BodyError(f"{_join(field, bad)} is not text (it holds a lone surrogate); send UTF-8")
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise BodyError(describe(exc, data, field)) from None


def describe(exc: msgspec.ValidationError, data: Any, field: str = "") -> str:
    """msgspec's account of a bad value, reworded as the site's APIs word their refusals."""
    text = str(exc)
    where = _WHERE.search(text)
    path = where["path"] if where else ""
    if where:
        text = text[: where.start()]
    name = _join(field, path)
    if where and where["key"]:
        name = f"a key in {name or 'the body'}"
    if missing := _MISSING.match(text):
        return f"{_join(name, '.' + missing['name'])} is required"
    if wrong := _WRONG_TYPE.match(text):
        if wrong["got"] == "null":  # a null where no null is allowed: as good as absent
            return f"{name or 'the body'} is required"
        must = f"{name or 'the body'} must be {_words(wrong['wanted'])}"
        value = _at(data, path)
        return f"{must}, got {value!r}" if isinstance(value, str | int | float) else must
    if constrained := _CONSTRAINED.match(text):
        return f"{name or 'the body'} must be {_words(constrained['wanted'])} {constrained['rule']}"
    return f"{name or 'the body'}: {text}"


def _join(field: str, path: str) -> str:
    path = path.lstrip(".")
    return f"{field}.{path}" if field and path else field or path


def _words(wanted: str) -> str:
    """``int | null`` → "an integer": a null the type allows is the field left out, not a kind of value."""
    kinds = [_WORDS.get(kind, kind) for kind in wanted.split(" | ") if kind != "null"]
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def _at(data: Any, path: str) -> Any:
    """The value at a msgspec path such as ``.size`` (fields only; None where the path goes elsewhere)."""
    for part in filter(None, path.split(".")):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data

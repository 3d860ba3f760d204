"""Text from strangers: JSON can carry lone surrogates ("\\ud800"), which are not text at all.

Python accepts them in a ``str``; UTF-8 encoders, hashes of the text and
PostgreSQL do not, so one such value used to surface as an HTTP 500. Every
JSON body's strings are checked here, where they enter, and refused with a
message that names the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def not_text(data: Any, path: str = "") -> Iterator[str]:
    """The paths of the keys and strings in decoded JSON ``data`` that are not text."""
    if isinstance(data, str):
        if not is_text(data):
            yield path or "the body"
    elif isinstance(data, dict):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not is_text(key):
                yield f"a key in {path or 'the body'}"
            else:
                yield from not_text(value, where)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from not_text(value, f"{path}[{i}]")

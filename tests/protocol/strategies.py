"""Hypothesis strategies that build any protocol message from its type hints."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from hypothesis import strategies as st

JSON_SCALARS = st.one_of(st.integers(-(2**31), 2**31), st.text(max_size=8), st.booleans())


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    origin = get_origin(hint)
    if origin is Literal:
        return st.sampled_from(get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else strategy_for(a) for a in get_args(hint)))
    if origin is list:
        return st.lists(strategy_for(get_args(hint)[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), JSON_SCALARS, max_size=3)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return st.builds(hint, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(hint) if f.name != "kind"})
    return {
        int: st.integers(-(2**53), 2**53),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(max_size=20),
        bool: st.booleans(),
    }[hint]

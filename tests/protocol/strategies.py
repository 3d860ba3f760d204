"""Hypothesis strategies for protocol messages, read off msgspec's view of each type (bounds included)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
from hypothesis import strategies as st

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=8),
                         st.floats(allow_nan=False, allow_infinity=False))  # fmt: skip
# Any JSON at all, nested a little: what a stranger might put where a message is expected.
ANY_JSON = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


def strategy_for(kind: Any) -> st.SearchStrategy[Any]:
    """Valid values of ``kind``: a message class, or a type as ``msgspec.inspect`` describes it."""
    info = kind if isinstance(kind, msgspec.inspect.Type) else msgspec.inspect.type_info(kind)
    return _strategy(info)


def _strategy(t: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    i = msgspec.inspect
    if isinstance(t, i.StructType):
        fields = {f.name: _strategy(f.type) for f in t.fields}
        return st.builds(t.cls, **fields)
    if isinstance(t, i.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, i.UnionType):
        return st.one_of(*(_strategy(m) for m in t.types))
    if isinstance(t, i.NoneType):
        return st.none()
    if isinstance(t, i.BoolType):
        return st.booleans()
    if isinstance(t, i.IntType):
        low = -(2**53) if t.ge is None else t.ge
        high = 2**53 if t.le is None else t.le
        return st.integers(low, high)
    if isinstance(t, i.FloatType):
        low = -1e30 if t.ge is None else t.ge
        high = 1e30 if t.le is None else t.le
        return st.floats(low, high, allow_nan=False, allow_infinity=False).filter(math.isfinite)
    if isinstance(t, i.StrType):
        if t.pattern == "^[0-9a-f]{64}$":
            return st.text("0123456789abcdef", min_size=64, max_size=64)
        if t.pattern == "^(?:[0-9a-f]{64})?$":
            return st.just("") | st.text("0123456789abcdef", min_size=64, max_size=64)
        return st.text(max_size=min(t.max_length or 20, 20))
    if isinstance(t, i.ListType):
        return st.lists(_strategy(t.item_type), max_size=3)
    if isinstance(t, i.DictType):
        return st.dictionaries(st.text(max_size=8), _strategy(t.value_type), max_size=3)
    raise TypeError(f"no strategy for {t!r}")

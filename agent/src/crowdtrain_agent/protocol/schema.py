"""Typed, bounded message structs and the strict-but-forward-compatible checks behind them.

Messages are msgspec Structs: msgspec parses and validates a frame in one C
pass, much faster than a checker written in Python (docs/performance.md,
"msgspec messages"), and it is *total*: for any input it returns a struct or raises one of its own
errors, which this module turns into ``ProtocolError`` naming the field.

Every number a peer sends is bounded where it is read (the aliases below), so
``10**400``, ``1e308`` or a negative count never reach code that would choke
on them. Fields a newer minor version of the protocol added are *ignored*
(and reported to the caller, which logs them once per connection), never
refused: that is what lets volunteers upgrade at their own pace.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from .errors import ProtocolError

T = TypeVar("T")

# ------------------------------------------------------------------ bounded types

MAX_SAFE_INT = 2**53  # what every JSON reader (JavaScript's included) keeps exact

Id = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
SliceIndex = Annotated[int, msgspec.Meta(ge=-1, le=1 << 16)]  # -1: "no slice of that campaign here"
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e21)]  # samples/s, FLOP/s
Real = Annotated[float, msgspec.Meta(ge=-1e30, le=1e30)]  # a finite measurement (a loss sum)
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Name = Annotated[str, msgspec.Meta(max_length=200)]
Text = Annotated[str, msgspec.Meta(max_length=8192)]
Token = Annotated[str, msgspec.Meta(max_length=4096)]
Url = Annotated[str, msgspec.Meta(max_length=2048)]
ConfigScalar = int | float | str | bool | None
# Model and optimizer configs are flat: nothing a peer sends can nest deeper than this.
ConfigValue = ConfigScalar | list[ConfigScalar]


class Part(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A structured field inside messages (device info, sample ranges...).

    ``since`` maps fields to the protocol minor version that added them: an
    encoder speaking an older minor leaves them out (see ``to_wire``).
    """

    since: ClassVar[dict[str, int]] = {}
    # Fields an older peer may go without even when set (it only loses a check, never a meaning).
    advisory: ClassVar[frozenset[str]] = frozenset()
    # Values a later minor added to a field's choices (field -> value -> minor): an older peer's decoder
    # refuses them, so a message holding one is never sent to it, advisory or not (see ``lost_in``).
    since_values: ClassVar[dict[str, dict[str, int]]] = {}


class Message(Part, frozen=True, tag_field="kind"):
    """A protocol message; its wire tag is the ``kind`` key."""

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


# ------------------------------------------------------------------ errors

_AT = re.compile(r" - at `\$(.*)`$")


def explain(exc: msgspec.MsgspecError, where: str, cls: type | None = None) -> ProtocolError:
    """msgspec's error as a ProtocolError that names ``where`` and the field path (and the choices, for a choice)."""
    text = str(exc)
    match = _AT.search(text)
    path = ""
    if match:
        text, path = text[: match.start()], match.group(1)
    if text.startswith("Object missing required field"):
        text = "missing field " + text.removeprefix("Object missing required field ").replace("`", "'")
    text = text.replace("`", "")
    if text.startswith("Invalid enum value") and cls is not None:
        choices = _choices(cls, path)
        if choices:
            text += f"; expected one of {choices}"
    return ProtocolError(f"{where}{path}: {text[:1].lower()}{text[1:]}")


def _choices(cls: type, path: str) -> list[Any] | None:
    """The values a Literal field at ``path`` (".a.b[0].c") of ``cls`` allows, if that is what it is."""
    kind: Any = msgspec.inspect.type_info(cls)
    for name in re.findall(r"\.(\w+)", path):
        while isinstance(kind, (msgspec.inspect.ListType, msgspec.inspect.UnionType)):
            kind = (
                kind.item_type
                if isinstance(kind, msgspec.inspect.ListType)
                else next((t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)), None)
            )
        if not isinstance(kind, msgspec.inspect.StructType):
            return None
        kind = next((f.type for f in kind.fields if f.encode_name == name), None)
    if isinstance(kind, msgspec.inspect.UnionType):
        kind = next((t for t in kind.types if isinstance(t, msgspec.inspect.LiteralType)), None)
    return list(kind.values) if isinstance(kind, msgspec.inspect.LiteralType) else None


# ------------------------------------------------------------------ forward compatibility


@cache
def _fields(cls: type) -> dict[str, Any]:
    """A struct's field names and their types, as msgspec sees them."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.encode_name: f.type for f in info.fields}


def _struct_of(kind: msgspec.inspect.Type) -> type | None:
    """The struct class a field holds (directly, in a list, or in an optional), if any."""
    if isinstance(kind, msgspec.inspect.StructType):
        return kind.cls
    if isinstance(kind, msgspec.inspect.ListType):
        return _struct_of(kind.item_type)
    if isinstance(kind, msgspec.inspect.UnionType):
        for member in kind.types:
            found = _struct_of(member)
            if found is not None:
                return found
    return None


def strip_unknown(cls: type, data: Any, path: str = "") -> list[str]:
    """Remove, in place, the keys of ``data`` that ``cls`` (and its nested structs) do not declare.

    Returns:
        The paths removed, for the caller to log.
    """
    if not isinstance(data, dict):
        return []
    fields = _fields(cls)
    tag = getattr(getattr(cls, "__struct_config__", None), "tag_field", None)
    removed = [f"{path}.{k}" if path else str(k) for k in data if k not in fields and k != tag]
    for key in [k for k in data if k not in fields and k != tag]:
        del data[key]
    for name, kind in fields.items():
        nested = _struct_of(kind)
        if nested is None or name not in data:
            continue
        value = data[name]
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            where = f"{path}.{name}" if path else name
            removed += strip_unknown(nested, item, f"{where}[{i}]" if isinstance(value, list) else where)
    return removed


def from_dict(cls: type[T], data: Any, where: str | None = None, *, unknown: list[str] | None = None) -> T:
    """Build struct ``cls`` from plain JSON data (a campaign's stored optimizer, a ticket), checking every field.

    Keys ``cls`` does not declare are dropped and listed in ``unknown`` when
    given (data written by a newer version); otherwise they are an error.

    Raises:
        ProtocolError: naming the first field that is missing or of the wrong type.
    """
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    if unknown is not None:
        data = copy.deepcopy(data)  # stripped in place: not the caller's
        unknown += strip_unknown(cls, data)
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise explain(exc, where, cls) from None


def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON-ready form of a struct (every field, defaults included)."""
    result = msgspec.to_builtins(obj)
    assert isinstance(result, dict)
    return result


def to_wire(obj: Any, minor: int) -> Any:
    """The JSON-ready form of a struct for a peer that speaks ``minor``: fields added later are left out."""
    data = msgspec.to_builtins(obj)
    _drop_newer(type(obj), data, minor)
    return data


def _drop_newer(cls: type, data: Any, minor: int) -> None:
    if not isinstance(data, dict):
        return
    for name, added in cls.since.items():  # type: ignore[attr-defined]
        if added > minor:
            data.pop(name, None)
    for name, kind in _fields(cls).items():
        nested = _struct_of(kind)
        if nested is not None and name in data:
            value = data[name]
            for item in value if isinstance(value, list) else [value]:
                _drop_newer(nested, item, minor)


def lost_in(obj: Any, minor: int, path: str = "") -> list[str]:
    """Fields a peer speaking ``minor`` would not get although they are set: the message means something else to it.

    Leaving out a field at its default changes nothing, nor does leaving out
    an ``advisory`` one; anything else must not be sent to that peer. Nor may
    a value its minor did not know yet (``since_values``: an ``int8`` codec).
    """
    cls = type(obj)
    lost = []
    for info in msgspec.structs.fields(cls):
        value = getattr(obj, info.name)
        if isinstance(value, str) and cls.since_values.get(info.name, {}).get(value, 0) > minor:
            lost.append(f"{path}{info.name}={value}")
        if cls.since.get(info.name, 0) > minor and info.name not in cls.advisory:
            default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
            if info.required or value != default:
                lost.append(f"{path}{info.name}")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Part):
                lost += lost_in(item, minor, f"{path}{info.name}.")
    return lost


@cache
def newest_field(cls: type) -> int:
    """The newest minor that added a field to ``cls`` or any struct inside it (0: none since the first)."""
    newest = max(cls.since.values(), default=0)  # type: ignore[attr-defined]
    for kind in _fields(cls).values():
        nested = _struct_of(kind)
        if nested is not None and nested is not cls:
            newest = max(newest, newest_field(nested))
    return newest

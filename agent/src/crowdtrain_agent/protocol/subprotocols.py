"""Which protocol minor a WebSocket connection speaks: the subprotocol ``crowdtrain.<major>.<minor>``.

A server reads the offer before the client has shown any token, so this is
the first thing a stranger's bytes reach: every function here is total, and
an odd offer is refused with a ``SubprotocolError`` that names it.

A browser's WebSocket cannot set an ``Authorization`` header, so a browser
tab (2.10) offers its device token as one more subprotocol,
``crowdtrain.bearer.<token>``. A server never picks that one (the answer is
echoed in the clear and would sit in logs), and no error here ever quotes it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import ProtocolError
from .frames import PROTOCOL_MINOR, PROTOCOL_VERSION, CloseCode

SUBPROTOCOL_PREFIX = f"crowdtrain.{PROTOCOL_VERSION}."
# What a server reads of a client's offer before it knows who the client is: an agent offers two
# subprotocols of some 15 characters. Anything past these bounds is refused, never parsed further.
MAX_OFFERED_SUBPROTOCOLS = 16
MAX_SUBPROTOCOL_CHARS = 64
MAX_SUBPROTOCOL_HEADER_CHARS = MAX_OFFERED_SUBPROTOCOLS * (MAX_SUBPROTOCOL_CHARS + 2)
MAX_MINOR_DIGITS = 4
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token characters, ASCII only
BEARER_SUBPROTOCOL_PREFIX = "crowdtrain.bearer."
# A device token is "ctd_" and 43 url-safe characters (``crowdtrain.accounts.tokens.new_token``): 47. The offer
# carrying one is the only subprotocol allowed past MAX_SUBPROTOCOL_CHARS, and only by this much.
MAX_BEARER_TOKEN_CHARS = 64
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9_-]+")  # what secrets.token_urlsafe and our prefixes are made of
_MINOR = re.compile(rf"0|[1-9][0-9]{{0,{MAX_MINOR_DIGITS - 1}}}")


class SubprotocolError(ProtocolError):
    """An offer of subprotocols no client of ours makes; the handshake is refused with this reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message, close_code=CloseCode.UNSUPPORTED_VERSION, fatal=True)


def subprotocol(minor: int) -> str:
    return f"{SUBPROTOCOL_PREFIX}{minor}"


def offered_subprotocols(newest: int = PROTOCOL_MINOR) -> list[str]:
    """What a client offers, preferred first: its own minor, then the one before (a site not upgraded yet)."""
    return [subprotocol(m) for m in range(newest, max(0, newest - 1) - 1, -1)]


def subprotocols_in_header(value: str) -> list[str]:
    """The subprotocols a ``Sec-WebSocket-Protocol`` header offers, in order; empty list items are skipped.

    Raises:
        SubprotocolError: if the header is longer than any honest offer or holds
            anything but printable ASCII (what a server would otherwise decode
            and crash on, before any token is checked).
    """
    if len(value) > MAX_SUBPROTOCOL_HEADER_CHARS:
        raise SubprotocolError(
            f"the Sec-WebSocket-Protocol header holds {len(value)} characters, more than the "
            f"{MAX_SUBPROTOCOL_HEADER_CHARS} any client needs; offer at most {MAX_OFFERED_SUBPROTOCOLS} subprotocols"
        )
    if not value.isascii() or not value.replace("\t", " ").isprintable():
        raise SubprotocolError("the Sec-WebSocket-Protocol header holds characters other than printable ASCII")
    if "%" in value:  # a server that percent-decodes offers (daphne) would see other ones than we checked
        raise SubprotocolError("the Sec-WebSocket-Protocol header holds a percent sign; offer plain tokens")
    return [item for item in (part.strip(" \t") for part in value.split(",")) if item]


def bearer_subprotocol(token: str) -> str:
    """What a client that cannot set headers (a browser tab) offers besides its minors, to show ``token``."""
    return f"{BEARER_SUBPROTOCOL_PREFIX}{token}"


def _bearer_of(value: str) -> str:
    """The token of one ``crowdtrain.bearer.`` offer; the errors never quote it (it is a secret)."""
    token = value.removeprefix(BEARER_SUBPROTOCOL_PREFIX)
    if not token:
        raise SubprotocolError(
            f"the subprotocol {BEARER_SUBPROTOCOL_PREFIX!r} holds no token; offer "
            f"{BEARER_SUBPROTOCOL_PREFIX!r} followed by the device token the site gave this tab"
        )
    if len(token) > MAX_BEARER_TOKEN_CHARS:
        raise SubprotocolError(
            f"the {BEARER_SUBPROTOCOL_PREFIX}<token> offer holds a token of {len(token)} characters, more than the "
            f"{MAX_BEARER_TOKEN_CHARS} a device token has; offer the token the site gave this tab"
        )
    if not _BEARER_TOKEN.fullmatch(token):
        raise SubprotocolError(
            f"the {BEARER_SUBPROTOCOL_PREFIX}<token> offer holds a token with characters no device token has "
            "(only ASCII letters, digits, '-' and '_'); offer the token the site gave this tab"
        )
    return token


def offered_bearer(offered: Sequence[str]) -> str | None:
    """The device token a client offered as ``crowdtrain.bearer.<token>``, or None when it offered none.

    Raises:
        SubprotocolError: when it offered more than one, or one that cannot be a token
            (``choose_subprotocol`` refuses the same offers, before any of this is read).
    """
    found = [_bearer_of(value) for value in offered if value.startswith(BEARER_SUBPROTOCOL_PREFIX)]
    if len(found) > 1:
        raise SubprotocolError(
            f"{len(found)} {BEARER_SUBPROTOCOL_PREFIX}<token> offers; a client offers its device token once"
        )
    return found[0] if found else None


def choose_subprotocol(offered: Sequence[str], newest: int = PROTOCOL_MINOR) -> tuple[str | None, int]:
    """A server's pick among a client's offered subprotocols: the newest minor both speak.

    Total on anything a client may send, before it has shown a token: every
    offer is a short ASCII token, and one of ours names its minor in canonical
    decimal, so the pick is always a string the client offered, never a
    rewritten one ("crowdtrain.2.04" is refused, not answered with "…2.4").
    A ``crowdtrain.bearer.<token>`` offer is checked (``offered_bearer``) and
    never picked.

    Returns:
        The subprotocol to accept with (None: none offered that we speak; the
        client then speaks minor 0, a 2.0 peer) and the minor in use.

    Raises:
        SubprotocolError: naming the first odd offer; the server refuses the
            handshake with it (HTTP 400, or close 4004 once accepted).
    """
    if len(offered) > MAX_OFFERED_SUBPROTOCOLS:
        raise SubprotocolError(
            f"{len(offered)} subprotocols offered; a client offers at most {MAX_OFFERED_SUBPROTOCOLS} "
            f"(an agent offers its own minor and the one before, as in {subprotocol(PROTOCOL_MINOR)})"
        )
    offered_bearer(offered)
    best: tuple[int, str] | None = None
    for value in offered:
        if value.startswith(BEARER_SUBPROTOCOL_PREFIX):
            continue  # checked above; never picked, never quoted
        shown = ascii(value[:40])
        if len(value) > MAX_SUBPROTOCOL_CHARS:
            raise SubprotocolError(
                f"subprotocol {shown}... holds {len(value)} characters, more than the {MAX_SUBPROTOCOL_CHARS} allowed"
            )
        if not _TOKEN.fullmatch(value):
            raise SubprotocolError(f"subprotocol {shown} is not a token: ASCII letters, digits, !#$%&'*+-.^_`|~")
        if not value.startswith(SUBPROTOCOL_PREFIX):
            continue  # another protocol, or another major: not ours to pick
        digits = value.removeprefix(SUBPROTOCOL_PREFIX)
        if not _MINOR.fullmatch(digits):
            raise SubprotocolError(
                f"subprotocol {shown} does not name a minor: after {SUBPROTOCOL_PREFIX!r} come 1 to "
                f"{MAX_MINOR_DIGITS} ASCII digits without leading zeros, as in {subprotocol(PROTOCOL_MINOR)!r}"
            )
        minor = int(digits)
        if minor <= newest and (best is None or minor > best[0]):
            best = (minor, value)
    return (best[1], best[0]) if best is not None else (None, 0)


def negotiated_minor(chosen: str | None) -> int:
    """The minor a client speaks with a server that accepted ``chosen`` (None: a 2.0 server, minor 0).

    A server that answers with anything but one of ours in canonical form is
    treated as a 2.0 server, not trusted with ``int()``.
    """
    if chosen and chosen.startswith(SUBPROTOCOL_PREFIX) and _MINOR.fullmatch(chosen.removeprefix(SUBPROTOCOL_PREFIX)):
        return int(chosen.removeprefix(SUBPROTOCOL_PREFIX))
    return 0

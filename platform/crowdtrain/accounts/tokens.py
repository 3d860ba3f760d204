"""API tokens: random, shown once, stored only as a SHA-256 hash.

Tokens carry 256 bits of randomness, so a fast hash is enough: nobody can
brute-force them, and looking one up is a single indexed query.
"""

from __future__ import annotations

import hashlib
import secrets


def new_token(prefix: str) -> str:
    """A fresh token like ``ctd_<43 url-safe chars>``; the prefix says what it is for."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(headers: list[tuple[bytes, bytes]] | dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer`` header, from ASGI or Django headers."""
    if isinstance(headers, dict):
        value = headers.get("Authorization") or headers.get("authorization") or ""
    else:
        value = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None

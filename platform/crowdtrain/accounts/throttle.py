"""Fixed-window counters in Django's cache, for the few endpoints a stranger could hammer."""

from __future__ import annotations

import time

from django.core.cache import cache
from django.http import HttpRequest

# Not allauth's ACCOUNT_RATE_LIMITS, which already guard what allauth serves (log-in failures, sign-ups; see
# settings): these counters guard our own device login, the code endpoint per address and the codes typed on
# /device/. allauth's limiter reaches other views only through allauth.core.ratelimit.consume, which allauth
# marks for deprecation ("keep rate limiting internal to allauth"); an upgrade could take it away.
WINDOW_S = 600


def _bucket(key: str, window_s: int) -> str:
    return f"crowdtrain.throttle.{key}.{int(time.time() // window_s)}"


def hit(key: str, limit: int, window_s: int = WINDOW_S) -> bool:
    """Count one event for ``key``; True when that makes more than ``limit`` in the current window."""
    bucket = _bucket(key, window_s)
    cache.add(bucket, 0, timeout=window_s)
    try:
        count = cache.incr(bucket)
    except ValueError:  # evicted between add and incr
        cache.set(bucket, 1, timeout=window_s)
        count = 1
    return count > limit


def exceeded(key: str, limit: int, window_s: int = WINDOW_S) -> bool:
    """True when ``key`` already has ``limit`` events in the current window (counts nothing)."""
    return cache.get(_bucket(key, window_s), 0) >= limit


def client_ip(request: HttpRequest) -> str:
    # REMOTE_ADDR only: X-Forwarded-For is whatever the client wants it to be. Behind a
    # reverse proxy run daphne with --proxy-headers, which puts the real address here.
    return request.META.get("REMOTE_ADDR") or "unknown"

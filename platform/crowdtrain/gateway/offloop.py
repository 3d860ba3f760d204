"""Run the scheduler's synchronous calls off the event loop, in a pool of threads.

Not on Channels' one database thread (``database_sync_to_async``): the lease
and done paths talk to Redis and write the database in batches, and one slow
call must not queue every other socket's call behind it. Each pool thread
keeps its own database connection. It is checked (Django's health check, a
``SELECT 1`` on PostgreSQL) at most every ``HEALTH_CHECK_EVERY_S`` per
thread and after any call that failed on it, not before every call: with
thousands of agents connecting, the check before each token lookup was a
third of the site's database time. A connection that died with a restarted
PostgreSQL is therefore replaced after the first call that fails on it. A
failed call is not run again here: the scheduler's calls change Redis, and a
report counted twice would be refused as "already reported" while its step
waited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connections

P = ParamSpec("P")
R = TypeVar("R")

HEALTH_CHECK_EVERY_S = 5.0
_checked = threading.local()


def _needs_check(now: float) -> bool:
    if now - getattr(_checked, "at", float("-inf")) >= HEALTH_CHECK_EVERY_S:
        return True
    # Django marks a connection on which a query failed (other than bad data or a broken constraint).
    return any(conn.errors_occurred for conn in connections.all(initialized_only=True))


def _with_fresh_connection(fn: Callable[P, R]) -> Callable[P, R]:
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        now = time.monotonic()
        if _needs_check(now):
            close_old_connections()  # drops connections past their age or broken; a health check marks them
            _checked.at = now
        return fn(*args, **kwargs)

    return call


def offloop(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``fn`` as a coroutine function that runs it in the pool."""
    return sync_to_async(_with_fresh_connection(fn), thread_sensitive=False)

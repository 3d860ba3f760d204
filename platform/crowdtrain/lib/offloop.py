"""Run the scheduler's synchronous calls off the event loop, in a pool of threads.

Not on Channels' one database thread (``database_sync_to_async``): the lease
and done paths talk to Redis and write the database in batches, and one slow
call must not queue every other socket's call behind it. Each pool thread
keeps its own database connection, checked now and then
(``crowdtrain.lib.connections``). A failed call is not run again here: the
scheduler's calls change Redis, and a report counted twice would be refused
as "already reported" while its step waited.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async

from crowdtrain.lib.connections import refresh_if_due

P = ParamSpec("P")
R = TypeVar("R")


def _with_fresh_connection(fn: Callable[P, R]) -> Callable[P, R]:
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        refresh_if_due()
        return fn(*args, **kwargs)

    return call


def offloop(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``fn`` as a coroutine function that runs it in the pool."""
    return sync_to_async(_with_fresh_connection(fn), thread_sensitive=False)

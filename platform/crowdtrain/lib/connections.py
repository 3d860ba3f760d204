"""A thread's database connection kept across calls, checked now and then rather than before each one.

Where calls come faster than a connection is worth opening, the site's
scheduler threads (``gateway.offloop``) and the Celery worker's tasks
(``celery``), a thread keeps its connection (``CROWDTRAIN_DB_CONN_MAX_AGE``).
It is checked (Django's health check, a ``SELECT 1`` on PostgreSQL) at most
every ``HEALTH_CHECK_EVERY_S`` per thread and after any call that failed on it:
with thousands of agents connecting, the check before each token lookup was a
third of the site's database time. A connection that died with a restarted
PostgreSQL is therefore replaced after the first call that fails on it.
"""

from __future__ import annotations

import threading
import time

from django.db import close_old_connections, connections

# Not Django's psycopg pool (OPTIONS "pool"): it needs CONN_MAX_AGE = 0, so every call would check a
# connection out and back in, and with CONN_HEALTH_CHECKS on it checks each one out with a round trip, the
# per-call check this module exists to avoid. Without checks a dead connection is found only by failing a
# call, once for every pooled connection. The threads here are long-lived: one connection each is the pool.
HEALTH_CHECK_EVERY_S = 5.0
_checked = threading.local()


def _due(now: float) -> bool:
    if now - getattr(_checked, "at", float("-inf")) >= HEALTH_CHECK_EVERY_S:
        return True
    # Django marks a connection on which a query failed (other than bad data or a broken constraint).
    return any(conn.errors_occurred for conn in connections.all(initialized_only=True))


def refresh_if_due() -> None:
    """Drop this thread's connections that are past their age or broken, if it is time to look."""
    now = time.monotonic()
    if _due(now):
        close_old_connections()  # drops connections past their age or broken; a health check marks them
        _checked.at = now

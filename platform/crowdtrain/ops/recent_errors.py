"""The site's ERROR log records of the last hour, kept in Redis for the dashboard: every process writes, any reads.

A logging handler (settings.LOGGING) pushes each ERROR record's time, logger
and first line of message to a capped Redis list. Redis, not each process's
memory, because the dashboard is served by one site process while errors
happen in any of them and in the Celery worker. Errors are rare, so the write
costs nothing that matters; a Redis that cannot be reached drops the record
(it is still in the process's own log) and never raises into the caller.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, cast

KEPT = 200  # records kept, newest first
WINDOW_S = 3600.0
MESSAGE_CHARS = 500

_writing = threading.local()  # a record logged while writing one (Redis failing) must not loop


def _key() -> str:
    from crowdtrain.scheduler.hotstate import hot_state

    return f"{hot_state().prefix}:errors"


class RecentErrorsHandler(logging.Handler):
    """Keeps the last ``KEPT`` ERROR records in Redis (installed on the ``crowdtrain`` and ``django`` loggers)."""

    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__(level)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(_writing, "active", False):
            return
        _writing.active = True
        try:
            from crowdtrain.scheduler.hotstate import hot_state

            message = record.getMessage().splitlines()[0] if record.msg else ""
            if record.exc_info and record.exc_info[1] is not None:
                message = f"{message} ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            entry = json.dumps({"at": record.created, "logger": record.name, "level": record.levelname,
                                "message": message[:MESSAGE_CHARS]})  # fmt: skip
            client = hot_state().client
            with client.pipeline(transaction=False) as pipe:
                pipe.lpush(_key(), entry)
                pipe.ltrim(_key(), 0, KEPT - 1)
                pipe.execute()
        except Exception:  # noqa: BLE001  (a log handler must never raise into the code that logged)
            pass
        finally:
            _writing.active = False


def recent(window_s: float = WINDOW_S, now: float | None = None) -> list[dict[str, Any]]:
    """ERROR records of the last ``window_s`` seconds, newest first."""
    from crowdtrain.scheduler.hotstate import hot_state

    now = time.time() if now is None else now
    raw = cast(list[str], hot_state().client.lrange(_key(), 0, KEPT - 1))
    records = [json.loads(item) for item in raw]
    return [r for r in records if now - float(r["at"]) <= window_s]

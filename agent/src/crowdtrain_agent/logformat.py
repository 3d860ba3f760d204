"""Log lines as one JSON object each, for the site, the aggregator and the agent alike (standard library only).

Why a ``logging.Formatter`` and not structlog: every module already logs with
``logger.info("lease %s ...", lease_id)``, and so do Django, Celery and
websockets. A formatter turns all of those lines into JSON with no change to
any call, and the agent, which volunteers install, gains no dependency. The ids
of the training path ride along as ``extra={"campaign_id": ..., "lease_id": ...}``
or, for a block of code, ``with log_ids(campaign_id=...)``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
# The ids a line of the training path may carry, as ``extra=`` keys or through ``log_ids``.
IDS = ("campaign_id", "lease_id", "device_id", "step", "slice_index", "aggregator")

_ids: ContextVar[dict[str, Any] | None] = ContextVar("crowdtrain_log_ids", default=None)


@contextmanager
def log_ids(**ids: Any) -> Iterator[None]:
    """Add ids to every line logged inside the block (in this thread or asyncio task).

    Args:
        ids: any of ``IDS``; None values are left out.
    """
    token = _ids.set({**(_ids.get() or {}), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _ids.reset(token)


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...ids, "exception"?}`` on one line.

    Time is UTC ISO 8601 with milliseconds; ids come from ``log_ids`` and then
    from the record's ``extra=``, which win.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_ids.get() or {})
        for key in IDS:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def parse_log_format(raw: str, where: str) -> str:
    """``text`` or ``json`` from a flag or variable.

    Raises:
        ValueError: naming ``where``, the value and what is accepted.
    """
    value = raw.strip().lower()
    if value not in LOG_FORMATS:
        raise ValueError(f"{where}={raw!r} is not a log format; use one of {', '.join(LOG_FORMATS)}")
    return value

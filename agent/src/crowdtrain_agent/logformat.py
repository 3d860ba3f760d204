"""Log lines as one JSON object each, for the site, the aggregator and the agent alike (standard library only).

Why a ``logging.Formatter`` and not structlog: every module already logs with
``logger.info("lease %s ...", lease_id)``, and so do Django, Celery and
websockets. A formatter turns all of those lines into JSON with no change to
any call, and the agent, which volunteers install, gains no dependency. The ids
of the training path ride along as ``extra={"campaign_id": ..., "lease_id": ...}``.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
# The ids a line of the training path may carry, as ``extra=`` keys.
IDS = ("campaign_id", "lease_id", "device_id", "step", "slice_index", "aggregator")


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...ids, "exception"?}`` on one line.

    Time is UTC ISO 8601 with milliseconds; ids come from the record's ``extra=``.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
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

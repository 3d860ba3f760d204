"""Helpers for the few hand-written statements that write a step's rows as one batch.

The ORM builds these statements fine, but for thousands of rows its per-row
objects and per-branch expressions cost more than the write itself (the step
commit, the lease record and the ledger were each measured so); these
statements name columns through the models, so a renamed field fails loudly.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Model


def column(model: type[Model], field: str) -> str:
    """A field's column, quoted for this backend."""
    return connection.ops.quote_name(next(f.column or f.name for f in model._meta.concrete_fields if f.name == field))


def table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def db_time(at: datetime) -> Any:
    """A timestamp as the backend stores it (what the ORM would send)."""
    return connection.ops.adapt_datetimefield_value(at)

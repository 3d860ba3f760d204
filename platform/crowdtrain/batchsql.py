"""Helpers for the few hand-written statements that write a step's rows as one batch.

The ORM builds these statements fine, but for thousands of rows its per-row
objects and per-branch expressions cost more than the write itself (the step
commit, the lease record and the ledger were each measured so); these
statements name columns through the models, so a renamed field fails loudly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Field, JSONField, Model


def _field(model: type[Model], name: str) -> Field[Any, Any]:
    return next(f for f in model._meta.concrete_fields if f.name == name)


def column(model: type[Model], field: str) -> str:
    """A field's column, quoted for this backend."""
    found = _field(model, field)
    return connection.ops.quote_name(found.column or found.name)


def table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def db_time(at: datetime) -> Any:
    """A timestamp as the backend stores it (what the ORM would send)."""
    return connection.ops.adapt_datetimefield_value(at)


def psycopg_reader(model: type[Model], field: str) -> Callable[[Any], Any]:
    """How a statement for PostgreSQL reads a field of a row: by its attribute (``campaign`` is
    ``campaign_id``), a JSON value wrapped for psycopg, and a choice as its text (psycopg would send
    an Enum's name)."""
    found = _field(model, field)
    read = operator.attrgetter(found.attname)
    if isinstance(found, JSONField):
        from psycopg.types.json import Jsonb  # PostgreSQL's driver: not needed by the embedded default

        return lambda row: Jsonb(read(row))
    if found.choices:
        return lambda row: str(read(row))
    return read

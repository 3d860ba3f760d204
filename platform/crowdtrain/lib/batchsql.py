"""Every SQL statement the site writes by hand, and the one write path of each table it serves.

The ORM builds all of these fine, but for a step's thousands of rows its per-row model objects
and per-branch expressions cost more than the write itself. Where that was measured, the write
is a statement here; everything else about those tables stays with the ORM in its own app. Each
function below is the only way its rows are written, on PostgreSQL and on SQLite alike: the
backend picks the statement (arrays joined with ``unnest`` on PostgreSQL, ``executemany`` by key
on SQLite, which runs in-process with no round trips), never the caller.

Why each is hand-written (the figure, the bench line that guards it, and the ledger entry of
docs/performance.md that tells the story):

====================  ===================================  =====================================  ==================
function              figure when it was written           guarding bench line                    ledger entry
====================  ===================================  =====================================  ==================
record_outcomes,      batches of 2-3 rows were a 7th of    site_cpu_ms_per_lease_<N>,             "Lease records"
insert_leases,        a site's CPU; bulk_update's CASE an  step_publish_s_<N>
move_cursors          8th under load (scale bench)
accept_leases,        a step of 2,000 leases of 1,000      commit_ms_<backend>_<leases>           "Step commits over
count_device_work,    devices: 939 -> 137 ms (PostgreSQL),                                        arrays"
insert_grants         983 -> 103 ms (SQLite)
open_check            two ORM saves: 7% of a site's        site_cpu_ms_per_lease_<N>              "Verification"
                      interpreter at a newcomer's check
                      rate (wide phase, 300 agents)
====================  ===================================  =====================================  ==================

The statements name tables and columns through the models they are given, so a renamed field fails
loudly; the models are passed in because this package sits below every app and imports none.
Rows are always locked and written in id order: two transactions (a lease batch and a step's
commit) that lock the same rows in opposite orders deadlock, and PostgreSQL breaks that only after
``deadlock_timeout`` (1 s).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Field, JSONField, Model, Q


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


def _on_postgresql() -> bool:
    return connection.vendor == "postgresql"


def lock_in_order(model: type[Model], ids: Collection[int]) -> None:
    """Lock rows in id order before a statement joined to arrays, which would lock in its own order.

    FOR NO KEY UPDATE, the lock the UPDATE takes anyway: FOR UPDATE would also block the foreign-key
    checks (KEY SHARE) of transactions inserting rows that refer to these, a deadlock seen in the scale
    bench at 300 agents. SQLite locks the whole database for a write, so it needs nothing here.
    """
    if ids and _on_postgresql():
        pk = column(model, "id")
        with connection.cursor() as db:
            db.execute(
                f"SELECT 1 FROM {table(model)} WHERE {pk} = ANY(%s) ORDER BY {pk} FOR NO KEY UPDATE", [sorted(ids)]
            )


# ---------------------------------------------------------------------------------------------------------------
# Lease rows (scheduler.Lease): the batched record and a step's acceptance.


def record_outcomes(
    lease: type[Model],
    accepted: Sequence[tuple[int, float | None, float | None, datetime]],
    ended: Sequence[tuple[int, str, str, datetime]],
    *,
    accepted_state: str,
    active_state: str,
) -> None:
    """Write lease outcomes from the record: ``accepted`` as (id, loss, compute s, at), ``ended`` as
    (id, state, reason, at), each in id order.

    An acceptance lands only on a lease still active; an ending never on a lease of a committed step
    (an accepted one only when a rollback retires it). Not ``bulk_update``: its CASE over every row was
    resolved by Django's expressions on each batch.
    """
    leases = table(lease)
    pk, state, step, reason, finished_at, loss, compute = (
        column(lease, name) for name in ("id", "state", "step", "reason", "finished_at", "loss_sum", "compute_s")
    )
    with connection.cursor() as db:
        if _on_postgresql():
            if accepted:
                ids, losses, computed, times = (list(values) for values in zip(*accepted, strict=True))
                db.execute(
                    f"UPDATE {leases} SET {state} = %s, {loss} = v.loss, {compute} = v.cs, {finished_at} = v.t1 "
                    "FROM unnest(%s::bigint[], %s::float8[], %s::float8[], %s::timestamptz[]) AS v(id, loss, cs, t1) "
                    f"WHERE {leases}.{pk} = v.id AND {leases}.{state} = %s",
                    [accepted_state, ids, losses, computed, times, active_state],
                )
            if ended:
                ids, states, reasons, times = (list(values) for values in zip(*ended, strict=True))
                db.execute(
                    f"UPDATE {leases} SET {state} = v.st, {reason} = v.why, {finished_at} = v.t1 "
                    "FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::timestamptz[]) AS v(id, st, why, t1) "
                    f"WHERE {leases}.{pk} = v.id AND {leases}.{step} IS NULL",
                    [ids, [str(s) for s in states], reasons, times],
                )
            return
        if accepted:
            db.executemany(
                f"UPDATE {leases} SET {state} = %s, {loss} = %s, {compute} = %s, {finished_at} = %s "
                f"WHERE {pk} = %s AND {state} = %s",
                [(accepted_state, lo, cs, db_time(at), i, active_state) for i, lo, cs, at in accepted],
            )
        if ended:
            db.executemany(
                f"UPDATE {leases} SET {state} = %s, {reason} = %s, {finished_at} = %s "
                f"WHERE {pk} = %s AND {step} IS NULL",
                [(st, why, db_time(at), i) for i, st, why, at in ended],
            )


# Every column of a lease row a site writes when it issues one, with its PostgreSQL array type.
_LEASE_COLUMNS = (
    ("id", "bigint"),
    ("campaign", "bigint"),
    ("device", "bigint"),
    ("base_version", "bigint"),
    ("target_step", "bigint"),
    ("ranges", "jsonb"),
    ("epoch", "bigint"),
    ("num_samples", "bigint"),
    ("state", "text"),
    ("issued_at", "timestamptz"),
    ("deadline", "timestamptz"),
    ("finished_at", "timestamptz"),
    ("loss_sum", "float8"),
    ("compute_s", "float8"),
    ("reason", "text"),
    ("request_id", "text"),
)


def insert_leases(lease: type[Model], rows: Sequence[Model]) -> None:
    """New lease rows, in id order; a row another process wrote already is left as it is."""
    if not rows:
        return
    rows = sorted(rows, key=lambda row: row.pk)
    if not _on_postgresql():
        lease._default_manager.bulk_create(rows, ignore_conflicts=True)
        return
    names = ", ".join(column(lease, name) for name, _ in _LEASE_COLUMNS)
    arrays = ", ".join(f"%s::{kind}[]" for _, kind in _LEASE_COLUMNS)
    values = []
    for name, _ in _LEASE_COLUMNS:
        read = psycopg_reader(lease, name)
        values.append([read(row) for row in rows])
    with connection.cursor() as db:
        db.execute(
            f"INSERT INTO {table(lease)} ({names}) SELECT * FROM unnest({arrays}) AS v ORDER BY 1 "
            "ON CONFLICT DO NOTHING",
            values,
        )


def move_cursors(campaign: type[Model], cursors: Mapping[int, tuple[int, int]]) -> None:
    """Each campaign's (epoch, cursor) moved forward to the batch's, never back (another process may be ahead)."""
    if not cursors:
        return
    ids = sorted(cursors)
    if not _on_postgresql():
        for campaign_id in ids:
            at_epoch, at_cursor = cursors[campaign_id]
            campaign._default_manager.filter(pk=campaign_id).filter(
                Q(epoch__lt=at_epoch) | Q(epoch=at_epoch, cursor__lt=at_cursor)
            ).update(epoch=at_epoch, cursor=at_cursor)
        return
    campaigns = table(campaign)
    pk, epoch, cursor = (column(campaign, name) for name in ("id", "epoch", "cursor"))
    with connection.cursor() as db:
        db.execute(
            f"UPDATE {campaigns} SET {epoch} = v.epoch, {cursor} = v.cursor "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[]) AS v(id, epoch, cursor) "
            f"WHERE {campaigns}.{pk} = v.id AND "
            f"({campaigns}.{epoch} < v.epoch OR ({campaigns}.{epoch} = v.epoch AND {campaigns}.{cursor} < v.cursor))",
            [ids, [cursors[i][0] for i in ids], [cursors[i][1] for i in ids]],
        )


def accept_leases(
    lease: type[Model],
    step_id: int,
    outcomes: Sequence[tuple[int, float, datetime, float]],
    *,
    accepted_state: str,
) -> set[int]:
    """Mark existing lease rows accepted into a step; ``outcomes`` are (id, loss, finished at, compute s)
    in id order. Returns the ids that had a row (the caller inserts the others whole).

    Not ``bulk_create(update_conflicts=True)`` for all of them: building 2,000 model instances and their
    JSON ranges, and upserting every column, was a third of a step's write.
    """
    if not outcomes:
        return set()
    leases = table(lease)
    pk, state, step, loss, compute, finished_at, reason = (
        column(lease, name) for name in ("id", "state", "step", "loss_sum", "compute_s", "finished_at", "reason")
    )
    ids = [lease_id for lease_id, *_ in outcomes]
    with connection.cursor() as db:
        if _on_postgresql():
            _, losses, finished, computed = (list(values) for values in zip(*outcomes, strict=True))
            lock_in_order(lease, ids)
            db.execute(
                f"UPDATE {leases} SET {state} = %s, {step} = %s, {reason} = '', {loss} = v.loss, "
                f"{compute} = v.cs, {finished_at} = v.t1 "
                "FROM unnest(%s::bigint[], %s::float8[], %s::timestamptz[], %s::float8[]) AS v(id, loss, t1, cs) "
                f"WHERE {leases}.{pk} = v.id RETURNING {leases}.{pk}",
                [accepted_state, step_id, ids, losses, finished, computed],
            )
            return {row[0] for row in db.fetchall()}
        existing = set(lease._default_manager.filter(pk__in=ids).values_list("pk", flat=True))
        db.executemany(
            f"UPDATE {leases} SET {state} = %s, {step} = %s, {reason} = '', {loss} = %s, {compute} = %s, "
            f"{finished_at} = %s WHERE {pk} = %s",
            [
                (accepted_state, step_id, loss_sum, compute_s, db_time(at), lease_id)
                for lease_id, loss_sum, at, compute_s in outcomes
                if lease_id in existing
            ],
        )
        return existing


# ---------------------------------------------------------------------------------------------------------------
# Devices (accounts.Device): the work a step credits to each.


def count_device_work(device: type[Model], work: Mapping[int, tuple[int, float]], weight: float) -> None:
    """Add each device's accepted samples and fold this step's rate into its moving-average speed.

    ``work`` maps a device to (samples, samples/s), a rate of 0 when the step gave none (the speed then
    stays). The average is computed in the UPDATE from the stored value, so concurrent commits cannot
    lose each other's measurement; a first measurement (stored 0) is taken as it is. Not one UPDATE
    with a CASE per device: Django resolved that expression's 3,000 branches in Python for a step of
    1,000 devices (more than a second).
    """
    if not work:
        return
    ids = sorted(work)
    devices = table(device)
    pk, accepted, speed = (column(device, name) for name in ("id", "samples_accepted", "samples_per_s"))
    with connection.cursor() as db:
        if _on_postgresql():
            lock_in_order(device, ids)
            db.execute(
                f"UPDATE {devices} SET {accepted} = {accepted} + v.n, {speed} = CASE WHEN v.rate <= 0 THEN {speed} "
                f"WHEN {speed} > 0 THEN {speed} * %s + %s * v.rate ELSE v.rate END "
                f"FROM unnest(%s::bigint[], %s::bigint[], %s::float8[]) AS v(id, n, rate) WHERE {devices}.{pk} = v.id",
                [1 - weight, weight, ids, [work[d][0] for d in ids], [work[d][1] for d in ids]],
            )
            return
        db.executemany(
            f"UPDATE {devices} SET {accepted} = {accepted} + %s, {speed} = CASE WHEN %s <= 0 THEN {speed} "
            f"WHEN {speed} > 0 THEN {speed} * %s + %s ELSE %s END WHERE {pk} = %s",
            [(work[d][0], work[d][1], 1 - weight, weight * work[d][1], work[d][1], d) for d in ids],
        )


# ---------------------------------------------------------------------------------------------------------------
# Credit (credit.CreditEntry): a step's grants.

# In the order of the SELECT in ``insert_grants``.
_GRANT_COLUMNS = (
    *("lease", "kind", "volunteer", "device", "team", "campaign", "samples", "flops", "reason", "created_at"),
)


def insert_grants(
    entry: type[Model],
    device: type[Model],
    profile: type[Model],
    *,
    kind: str,
    campaign_id: int,
    flops_per_sample: float,
    leases: Sequence[tuple[int, int, int]],
    when: datetime,
) -> list[tuple[int, int | None, float]]:
    """Grant entries for ``(lease, device, samples)``, joined to each device's owner and the owner's team;
    returns (volunteer, team, flops) of the entries written.

    A grant already there (the unique lease and kind) is neither written nor returned; a device gone
    is skipped. On PostgreSQL one INSERT joined to the leases as arrays (``RETURNING`` names only the
    rows inserted); on SQLite the owners in one query and ``bulk_create``.
    """
    if not leases:
        return []
    if not _on_postgresql():
        owners = {
            pk: (owner, team)
            for pk, owner, team in device._default_manager.filter(pk__in={d for _, d, _ in leases}).values_list(
                "pk", "owner_id", "owner__profile__team_id"
            )
        }
        already = set(
            entry._default_manager.filter(lease_id__in=[lease for lease, _, _ in leases], kind=kind).values_list(
                "lease_id", flat=True
            )
        )
        rows = [
            entry(
                lease_id=lease_id,
                kind=kind,
                volunteer_id=owners[device_id][0],
                device_id=device_id,
                team_id=owners[device_id][1],
                campaign_id=campaign_id,
                samples=samples,
                flops=samples * flops_per_sample,
                created_at=when,
            )
            for lease_id, device_id, samples in leases
            if device_id in owners and lease_id not in already
        ]
        entry._default_manager.bulk_create(rows, ignore_conflicts=True)
        return [(row.volunteer_id, row.team_id, row.flops) for row in rows]  # type: ignore[attr-defined]
    columns = {name: column(entry, name) for name in _GRANT_COLUMNS}
    device_id, owner = column(device, "id"), column(device, "owner")
    user, team = column(profile, "user"), column(profile, "team")
    lease_ids, device_ids, samples = (list(values) for values in zip(*leases, strict=True))
    with connection.cursor() as db:
        db.execute(
            f"INSERT INTO {table(entry)} ({', '.join(columns.values())}) "
            f"SELECT v.lease, %s, d.{owner}, v.device, p.{team}, %s, v.n, v.n * %s, '', %s "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[]) AS v(lease, device, n) "
            f"JOIN {table(device)} d ON d.{device_id} = v.device "
            f"LEFT JOIN {table(profile)} p ON p.{user} = d.{owner} "
            f"ON CONFLICT DO NOTHING RETURNING {columns['volunteer']}, {columns['team']}, {columns['flops']}",
            [kind, campaign_id, flops_per_sample, when, lease_ids, device_ids, samples],
        )
        return [(volunteer, team_id, flops) for volunteer, team_id, flops in db.fetchall()]


# ---------------------------------------------------------------------------------------------------------------
# Verification (verification.Check and Answer): a picked lease's check with its original answer.

_CHECK_COLUMNS = (
    *("campaign", "lease_id", "volunteer", "base_version", "ranges", "num_samples", "state", "detail"),
    *("created_at", "credited"),
)
_ANSWER_COLUMNS = (
    *("lease_id", "role", "volunteer", "device", "sketch", "reported_at", "verdict", "issued_at", "similar"),
)


def open_check(case: Model, original: Model) -> int:
    """Write a new check and its original answer, atomically; returns the check's id.

    On PostgreSQL one statement (a data-modifying ``WITH``), atomic on its own: two ORM inserts in a
    transaction were spent in Django's model saving rather than the database.
    """
    if not _on_postgresql():
        with transaction.atomic():
            case.save(force_insert=True)
            original.case = case  # type: ignore[attr-defined]
            original.save(force_insert=True)
        return int(case.pk)
    check, answer = type(case), type(original)
    values = [psycopg_reader(check, name)(case) for name in _CHECK_COLUMNS]
    values += [psycopg_reader(answer, name)(original) for name in _ANSWER_COLUMNS]
    with connection.cursor() as db:
        db.execute(_open_check_sql(check, answer), values)
        return int(db.fetchone()[0])


@functools.cache  # one process talks to one backend
def _open_check_sql(check: type[Model], answer: type[Model]) -> str:
    check_id = column(check, "id")
    answer_columns = ", ".join(column(answer, name) for name in ("case", *_ANSWER_COLUMNS))
    return (
        f"WITH c AS (INSERT INTO {table(check)} ({', '.join(column(check, name) for name in _CHECK_COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(_CHECK_COLUMNS))}) RETURNING {check_id}) "
        f"INSERT INTO {table(answer)} ({answer_columns}) "
        f"SELECT c.{check_id}, {', '.join(['%s'] * len(_ANSWER_COLUMNS))} FROM c RETURNING {column(answer, 'case')}"
    )

"""The scheduler's durable record, written behind the hot path in batches.

Leases are decided in Redis (``hotstate``); the database keeps what must
outlive any process: every lease with its samples and outcome, and each
campaign's cursor. A site process queues those writes and sends them every
quarter of a second (or every few hundred records) in one transaction: a few
statements per batch instead of several per lease. A step's commit does not
wait for the queue: it writes its own leases (``commit_rows``) in the same
transaction as the step.

Writes are idempotent and order-free across processes, so two processes
racing on one lease converge: a lease row is inserted only if missing, an
outcome lands only on a lease still active, and nothing here touches a lease
that is part of a committed step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import DatabaseError, IntegrityError, close_old_connections, transaction
from django.db.models import Model

from crowdtrain.campaigns.models import Campaign
from crowdtrain.lib import batchsql
from crowdtrain.lib.connections import refresh_if_due

from .models import Lease

logger = logging.getLogger(__name__)

# A batch is written when it is this old or this big, whichever comes first. Each batch costs a
# transaction and a few statements whatever its size, so batches of two or three cost a busy site
# process much of its CPU (docs/performance.md, "Lease records"). Nothing waits on these rows: a
# commit writes its own leases (``commit_rows``), and a site killed outright leaves its last batch
# to the rebuild from the hot state.
FLUSH_INTERVAL_S = 0.25
FLUSH_AT_RECORDS = 256
# A database that stays down must not eat the site's memory: past this many queued writes the
# oldest are dropped with an error (their leases still count; the record of them is what is lost).
MAX_QUEUED = 200_000


@dataclass
class Finished:
    lease_id: int
    state: str
    reason: str
    at: datetime
    loss_sum: float | None = None
    compute_s: float | None = None


class RecordWriter:
    """Queues lease rows and outcomes and writes them in batches.

    Args:
        inline: write at once in the caller's thread (tests, where the
            writes must share the test's transaction); otherwise a daemon
            thread writes every FLUSH_INTERVAL_S, or sooner once
            FLUSH_AT_RECORDS are queued.
        thread: start that thread (False: only ``flush`` writes, for tests
            that play several site processes).
    """

    def __init__(self, *, inline: bool, thread: bool = True) -> None:
        self.inline = inline
        self.thread = thread
        self._lock = threading.Lock()  # guards the queues
        self._write_lock = threading.Lock()  # one batch at a time, in order
        self._new: list[Lease] = []
        self._finished: list[Finished] = []
        self._cursors: dict[int, tuple[int, int]] = {}
        self._copies: list[Model] = []  # verification copies issued: their answer rows, unreported
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ queueing

    def lease_issued(self, lease: Lease) -> None:
        self._queue(lambda: self._new.append(lease))

    def lease_finished(self, finished: Finished) -> None:
        self._queue(lambda: self._finished.append(finished))

    def copy_issued(self, answer: Model) -> None:
        """A verification copy handed out: its answer row (verification's own model), still unreported."""
        self._queue(lambda: self._copies.append(answer))

    def cursor_moved(self, campaign_id: int, epoch: int, cursor: int) -> None:
        def keep_newest() -> None:
            if (epoch, cursor) > self._cursors.get(campaign_id, (-1, -1)):
                self._cursors[campaign_id] = (epoch, cursor)

        self._queue(keep_newest)

    def _queue(self, add: Callable[[], None]) -> None:
        with self._lock:
            add()
            backlog = len(self._new) + len(self._finished) + len(self._copies)
            if backlog >= FLUSH_AT_RECORDS:
                self._wake.set()
            if backlog > MAX_QUEUED:
                logger.error("the database is not keeping up: dropping %s queued lease records", backlog - MAX_QUEUED)
                del self._new[: len(self._new) // 2]
                del self._finished[: len(self._finished) // 2]
        if self.inline:
            self.flush()
        elif self.thread:
            self._ensure_thread()

    # ------------------------------------------------------------ writing

    def flush(self) -> None:
        """Write everything queued so far, in this thread."""
        with self._write_lock:
            with self._lock:
                new, finished, cursors = self._new, self._finished, self._cursors
                copies = self._copies
                self._new, self._finished, self._cursors, self._copies = [], [], {}, []
            if not (new or finished or cursors or copies):
                return
            try:
                if new or finished or cursors:
                    _write(new, finished, cursors)
                    new, finished, cursors = [], [], {}  # written: a failure below does not send them again
                if copies:
                    _write_copies(copies)
            except DatabaseError:
                held = len(new) + len(finished) + len(copies)
                logger.warning("writing %s lease records failed; retrying", held, exc_info=True)
                with self._lock:  # put them back in front, in order
                    self._new[:0] = new
                    self._finished[:0] = finished
                    self._copies[:0] = copies
                    for campaign_id, position in cursors.items():
                        if position > self._cursors.get(campaign_id, (-1, -1)):
                            self._cursors[campaign_id] = position
                raise

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="crowdtrain-records", daemon=True)
                    self._thread.start()
                    # A site stopped the ordinary way (SIGTERM, Ctrl-C: daphne stops its loop and Python
                    # exits) writes what it still holds; only kill -9 leaves the last batch to the rebuild.
                    atexit.unregister(self.flush_at_exit)  # once, however often the thread is restarted
                    atexit.register(self.flush_at_exit)

    def flush_at_exit(self) -> None:
        try:
            close_old_connections()
            self.flush()
        except Exception:
            logger.exception("could not write the last lease records before exit")

    def _loop(self) -> None:
        while True:
            self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            try:
                refresh_if_due()  # the thread's connection, checked now and then as the scheduler's threads do
                self.flush()
            except DatabaseError:
                # The database is away; the queue keeps the records meanwhile. A sleep, not a wait on
                # ``_wake``: a queue past FLUSH_AT_RECORDS sets it with every lease.
                time.sleep(1.0)
            except Exception:  # a bug must not stop the record for good
                logger.exception("the lease record writer failed")


def _write(new: Sequence[Lease], finished: Sequence[Finished], cursors: dict[int, tuple[int, int]]) -> None:
    """One batch in one transaction: existing rows locked and updated in id order, as a step's commit
    updates them, and new rows inserted last, so a step waiting on a new row's insert never holds a row
    this transaction still needs."""
    new, finished = _merged(new, finished)
    by_id = sorted(finished, key=lambda f: f.lease_id)
    accepted = [(f.lease_id, f.loss_sum, f.compute_s, f.at) for f in by_id if f.state == Lease.State.ACCEPTED]
    ended = [(f.lease_id, f.state, f.reason[:200], f.at) for f in by_id if f.state != Lease.State.ACCEPTED]
    with transaction.atomic():
        batchsql.lock_in_order(Lease, {f.lease_id for f in finished})
        batchsql.record_outcomes(
            Lease, accepted, ended, accepted_state=Lease.State.ACCEPTED, active_state=Lease.State.ACTIVE
        )
        batchsql.insert_leases(Lease, new)
        batchsql.move_cursors(Campaign, cursors)


def _write_copies(copies: Sequence[Model]) -> None:
    """Copies' answer rows, unless there already (the copy's report, in another process, can come first).

    The rows are verification's (the scheduler writes them in its batch, so a copy costs no write of its
    own on the lease path), of whatever model it handed over. A row the database refuses (its check or
    device deleted meanwhile) is dropped with a warning rather than held: one bad row must not keep every
    later batch from being written.
    """
    if not copies:
        return
    rows = type(copies[0])._default_manager
    try:
        with transaction.atomic():
            rows.bulk_create(copies, ignore_conflicts=True)
    except IntegrityError:
        for copy in copies:
            try:
                with transaction.atomic():
                    rows.bulk_create([copy], ignore_conflicts=True)
            except IntegrityError:
                logger.warning(
                    "dropping the answer of copy %s of check %s: the database refuses it",
                    getattr(copy, "lease_id", None),
                    getattr(copy, "case_id", None),
                    exc_info=True,
                )


def _merged(new: Sequence[Lease], finished: Sequence[Finished]) -> tuple[list[Lease], list[Finished]]:
    """The batch with the outcomes of leases issued in it written into their new rows, not sent as updates.

    At a cycle a second a lease is often issued and reported within one batch. Applied as the
    updates would apply them, in order: an acceptance only to a lease still active, an ending
    to any (a new row is never in a committed step).
    """
    rows = {lease.pk: lease for lease in new}
    left: list[Finished] = []
    for outcome in finished:
        row = rows.get(outcome.lease_id)
        if row is None:
            left.append(outcome)
        elif outcome.state != Lease.State.ACCEPTED:
            row.state, row.reason, row.finished_at = outcome.state, outcome.reason[:200], outcome.at
        elif row.state == Lease.State.ACTIVE:
            row.state, row.loss_sum, row.compute_s, row.finished_at = (
                outcome.state,
                outcome.loss_sum,
                outcome.compute_s,
                outcome.at,
            )
    return list(new), left


_writer_lock = threading.Lock()
_writer: RecordWriter | None = None


def writer() -> RecordWriter:
    """The process's writer (inline when CROWDTRAIN_RECORDS_INLINE is set, as the test suite does)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            from django.conf import settings

            _writer = RecordWriter(inline=settings.CROWDTRAIN_RECORDS_INLINE)
        return _writer


def reset_writer() -> None:
    """Drop the process's writer (tests switch between inline and batched writing)."""
    global _writer
    with _writer_lock:
        _writer = None

"""Lease ids, reserved from the database a block at a time.

A lease's id is chosen when Redis decides the lease, before its row is
written, and must never repeat: not across site processes, not after a
restart, not after Redis lost its keys (an aggregator may still hold an
upload under an old id). Each process takes a block of ids from ``IdBlock``,
one statement per thousand leases.
"""

from __future__ import annotations

import threading

from django.db import IntegrityError, transaction
from django.db.models import Max

from .models import IdBlock, Lease

LEASE_ID_BLOCK = 1000


class IdPool:
    """One process's ids: a block at a time, and ids of refused requests used again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._end = 0
        self._returned: list[int] = []

    def take(self) -> int:
        with self._lock:
            if self._returned:
                return self._returned.pop()
            if self._next >= self._end:
                self._next, self._end = _reserve_ids(LEASE_ID_BLOCK)
            self._next += 1
            return self._next - 1

    def put_back(self, lease_id: int) -> None:
        """An id taken for a request that was refused: most requests are, while every step is full."""
        with self._lock:
            if len(self._returned) < 64:
                self._returned.append(lease_id)

    def reset(self) -> None:
        with self._lock:
            self._next = self._end = 0
            self._returned = []


def _reserve_ids(size: int) -> tuple[int, int]:
    try:
        return _reserve_once(size)
    except IntegrityError:
        # Two processes found no block row at once (a new database) and both inserted it; the other won.
        # The row exists now, so the second try locks it like every later reservation.
        return _reserve_once(size)


def _reserve_once(size: int) -> tuple[int, int]:
    with transaction.atomic():
        block = IdBlock.objects.select_for_update().filter(name="lease").first()
        if block is None:
            # First use: start past any lease already recorded (rows from before id blocks existed).
            start = (Lease.objects.aggregate(m=Max("id"))["m"] or 0) + 1
            IdBlock.objects.create(name="lease", next_id=start + size)
            return start, start + size
        start = block.next_id
        block.next_id = start + size
        block.save(update_fields=["next_id"])
        return start, start + size


lease_ids = IdPool()

"""Lease ids come from blocks reserved in the database; two site processes that take the very first block at
once (a new database) both get ids, and no id twice, instead of one of them failing its lease request."""

from __future__ import annotations

import pytest
from django.db import IntegrityError

from crowdtrain.scheduler import ids
from crowdtrain.scheduler.models import IdBlock

pytestmark = pytest.mark.django_db


def test_a_process_that_lost_the_race_for_the_first_block_takes_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    real_reserve = ids._reserve_once
    lost: list[int] = []

    def other_process_first(size: int) -> tuple[int, int]:
        if not lost:
            # Both found no block row; the other process inserted its row and committed first, so this
            # process's insert fails (the savepoint it ran in is gone; the other's row is not).
            lost.append(size)
            IdBlock.objects.create(name="lease", next_id=1 + size)
            raise IntegrityError('duplicate key value violates unique constraint "scheduler_idblock_pkey"')
        return real_reserve(size)

    monkeypatch.setattr(ids, "_reserve_once", other_process_first)

    start, end = ids._reserve_ids(ids.LEASE_ID_BLOCK)

    assert lost == [ids.LEASE_ID_BLOCK]
    assert (start, end) == (1 + ids.LEASE_ID_BLOCK, 1 + 2 * ids.LEASE_ID_BLOCK)  # after the other's block
    assert IdBlock.objects.get(name="lease").next_id == end


def test_blocks_follow_each_other() -> None:
    first = ids._reserve_ids(10)
    second = ids._reserve_ids(10)

    assert first[1] == second[0] and second[1] - second[0] == 10

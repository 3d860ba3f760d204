"""When each aggregator was last heard from, in Redis: every site process writes, any one reads.

The database's ``Aggregator.last_seen_at`` is written once a minute (it is for
people); the silent-aggregator alert needs seconds, so each heartbeat stamps a
sorted set next to the scheduler's presence set: one ``ZADD`` per aggregator
every ``CROWDTRAIN_HEARTBEAT_S``, whatever the number of volunteers.
"""

from __future__ import annotations

from typing import cast

from crowdtrain.scheduler.hotstate import hot_state


def _key() -> str:
    return f"{hot_state().prefix}:aggseen"


def aggregator_heard(aggregator_id: int) -> None:
    """Stamp ``aggregator_id`` as heard from now (its socket said hello or sent a heartbeat)."""
    state = hot_state()
    state.client.zadd(_key(), {str(aggregator_id): state.clock()})


def heard_at() -> dict[int, float]:
    """Every aggregator's last heartbeat, as Unix seconds (aggregators never heard from are absent)."""
    raw = cast(list[tuple[str, float]], hot_state().client.zrange(_key(), 0, -1, withscores=True))
    return {int(member): float(score) for member, score in raw}

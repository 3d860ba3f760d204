"""Celery tasks that failed, counted in Redis by a ``task_failure`` signal, so any site process can report them.

Tasks run in the Celery worker, a process nobody scrapes; the failure lands in
a Redis hash (count and time per task name) that ``/metrics`` and ``/healthz``
of every site process read. A failure is rare, so its write costs nothing that
matters.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from crowdtrain.scheduler.hotstate import hot_state

logger = logging.getLogger(__name__)


def _keys() -> tuple[str, str]:
    prefix = hot_state().prefix
    return f"{prefix}:taskfail:n", f"{prefix}:taskfail:at"


def record_failure(task_name: str) -> None:
    """Count one failure of ``task_name``, now."""
    state = hot_state()
    count_key, at_key = _keys()
    with state.client.pipeline(transaction=False) as pipe:
        pipe.hincrby(count_key, task_name, 1)
        pipe.hset(at_key, task_name, repr(state.clock()))
        pipe.execute()


def failures() -> dict[str, tuple[int, float]]:
    """Per task name: (failures counted, Unix time of the last one)."""
    count_key, at_key = _keys()
    client = hot_state().client
    # decode_responses=True: names and values are str.
    counts = cast(dict[str, str], client.hgetall(count_key))
    times = cast(dict[str, str], client.hgetall(at_key))
    return {name: (int(counts[name]), float(times.get(name, 0.0))) for name in counts}


def _on_task_failure(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                     **_: Any) -> None:  # fmt: skip
    name = getattr(sender, "name", None) or str(sender)
    try:
        record_failure(name)
    except Exception:  # Redis down: the failure is still in the worker's log; the signal must not raise
        logger.warning("could not count the failure of task %s (%s)", name, task_id, exc_info=True)


def connect() -> None:
    """Listen for failures of every task (idempotent: Celery's signals keep one receiver per ``dispatch_uid``)."""
    from celery.signals import task_failure

    task_failure.connect(_on_task_failure, weak=False, dispatch_uid="crowdtrain.ops.task_failures")

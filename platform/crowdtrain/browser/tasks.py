"""Celery tasks of browser compute: exporting and gating a model's gradient graphs."""

from __future__ import annotations

from celery import shared_task

from . import checking


@shared_task
def check_browser_graph(graph_id: int) -> str | None:
    """Export and gate a pending ``BrowserGraph``; idempotent: a decided, taken or vanished row is skipped.

    No retries: a model that cannot be exported fails the same way again, and
    ``check_browser_graphs --again`` is the way to check once more.
    """
    graph = checking.run_check(graph_id)
    return graph.status if graph is not None else None

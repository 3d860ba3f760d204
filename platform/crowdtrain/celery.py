"""The Celery app; the embedded default runs tasks in-process, so no broker is needed.

A worker keeps its database connection from task to task, as a site
process's threads do (``crowdtrain.lib.connections``). Celery's Django fixup
would close it around every task (``CELERY_DB_REUSE_MAX`` unset), so each
verdict opened a new PostgreSQL connection, a backend forked for a dozen
queries (its share of the worker's time is in docs/performance.md).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import task_prerun

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")

app = Celery("crowdtrain")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
def _keep_the_connection_fresh(sender: Any = None, **_: Any) -> None:
    # Not for an eager task: it runs inside its caller's connection, maybe in its transaction.
    if sender is not None and not getattr(sender.request, "is_eager", False):
        from crowdtrain.lib.connections import refresh_if_due

        refresh_if_due()

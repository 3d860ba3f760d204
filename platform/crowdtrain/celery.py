"""The Celery app; the embedded default runs tasks in-process, so no broker is needed."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")

app = Celery("crowdtrain")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

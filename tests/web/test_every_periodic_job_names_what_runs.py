"""crowdtrain.periodic lists every periodic job of the site; each entry names code that exists (issue 35)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from django.conf import settings

from crowdtrain.celery import app
from crowdtrain.periodic import BEAT_JOBS, OWN_LOOPS, ROUND_JOBS, Job


def _resolve(dotted: str) -> Any:
    """The object at ``dotted``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("job", [*ROUND_JOBS, *OWN_LOOPS], ids=lambda job: job.name)
def test_each_job_names_code_that_exists(job: Job) -> None:
    assert callable(_resolve(job.call)), f"{job.name}: {job.call} is not what runs; fix its entry in periodic.py"


@pytest.mark.parametrize("job", BEAT_JOBS, ids=lambda job: job.name)
def test_each_beat_job_names_a_celery_task(job: Job) -> None:
    app.loader.import_default_modules()  # as a worker does at start: finds every app's tasks module

    assert job.call in app.tasks, f"{job.name}: no Celery task is named {job.call}; fix its entry in periodic.py"


def test_celery_beat_runs_exactly_the_listed_jobs() -> None:
    schedule = settings.CELERY_BEAT_SCHEDULE

    assert sorted(schedule) == sorted(job.name for job in BEAT_JOBS)

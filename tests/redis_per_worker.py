"""Give each pytest-xdist worker a Redis database of its own (``-p tests.redis_per_worker``).

Workers of the PostgreSQL + Redis pass get a database each from pytest-django;
without this they would share one Redis database, and one worker's tests would
meet the other's scheduler keys, channel groups and Celery queue (tried:
``HotStateMissing`` right after a load). Worker ``gwN`` takes database
``base - N`` (modulo 16) of the configured URL, so ``redis://…/15`` gives gw0 15, gw1 14.

A ``-p`` plugin because it must run before pytest-django loads the settings,
which read ``REDIS_URL`` once; xdist names the worker in its environment first.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

# Redis's default number of databases; a URL without one (database 0) gives gw1 database 15.
DATABASES = 16
# Every variable the settings read a Redis address from.
REDIS_VARIABLES = ("REDIS_URL", "CROWDTRAIN_SCHEDULER_REDIS_URL", "CELERY_BROKER_URL")


def database_for(url: str, worker: str) -> str:
    """``url`` moved to worker ``gwN``'s database; an error names a URL or worker that cannot be split."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("redis"):
        return url  # memory:// and the like: private to the process already
    base = int(parts.path.strip("/") or 0)
    number = int(worker.removeprefix("gw"))
    if number >= DATABASES:
        raise SystemExit(f"redis_per_worker: Redis has {DATABASES} databases, too few for worker {worker}")
    return urlunsplit(parts._replace(path=f"/{(base - number) % DATABASES}"))


_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    for _name in REDIS_VARIABLES:
        if os.environ.get(_name):
            os.environ[_name] = database_for(os.environ[_name], _worker)

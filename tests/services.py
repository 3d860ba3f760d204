"""Run a command with PostgreSQL and Redis reachable: the ones configured, or private ones started here.

    python -m tests.services python -m pytest tests/web

Reads DATABASE_URL and REDIS_URL (defaults: the machine's PostgreSQL on
127.0.0.1:5432, database ``test``, and Redis on 127.0.0.1:6379). When one does
not answer it starts its own from the Debian binaries in a temporary folder
(``crowdtrain_launcher.engines``, shared with ``crowdtrain_launcher.cluster``), and fails loudly,
never skipping, when it cannot.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as `python -m tests.services` from the repository root, before pytest puts the launcher on the path.
_LAUNCHER = str(Path(__file__).resolve().parents[1] / "deploy" / "launcher")
if _LAUNCHER not in sys.path:
    sys.path.insert(0, _LAUNCHER)

from crowdtrain_launcher.engines import EngineError, ensure_postgres, ensure_redis  # noqa: E402

__all__ = ["ensure_postgres", "ensure_redis"]

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    env = dict(os.environ)
    try:
        database_url = ensure_postgres(env.get("DATABASE_URL") or DEFAULT_DATABASE_URL)
        redis_url = ensure_redis(env.get("REDIS_URL") or DEFAULT_REDIS_URL)
    except EngineError as exc:
        raise SystemExit(f"services: {exc}") from None
    env["DATABASE_URL"], env["REDIS_URL"] = database_url, redis_url
    print(f"services: DATABASE_URL={env['DATABASE_URL']} REDIS_URL={env['REDIS_URL']}", file=sys.stderr)
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])

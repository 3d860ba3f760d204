"""Run a command with PostgreSQL and Redis reachable: the ones configured, or private ones started here.

    python -m tests.services python -m pytest tests/web

Reads DATABASE_URL and REDIS_URL (defaults: the machine's PostgreSQL on
127.0.0.1:5432, database ``test``, and Redis on 127.0.0.1:6379). When one does
not answer it starts its own from the Debian binaries in a temporary folder,
and fails loudly, never skipping, when it cannot.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(url: str, default_port: int, what: str) -> None:
    for _ in range(100):
        if _answers(url, default_port):
            return
        time.sleep(0.1)
    raise SystemExit(f"{what} started but does not answer at {url}")


def ensure_redis(url: str) -> str:
    if _answers(url, 6379):
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"Redis does not answer at {url} and redis-server is not installed: apt-get install redis-server")
    port = _free_port()
    subprocess.run([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                    "--daemonize", "yes"], check=True)  # fmt: skip
    own = f"redis://127.0.0.1:{port}/15"
    _wait(own, port, "redis-server")
    print(f"services: started a private Redis at {own}", file=sys.stderr)
    return own


def ensure_postgres(url: str) -> str:
    if _answers(url, 5432):
        return url
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise SystemExit(f"PostgreSQL does not answer at {url} and is not installed: apt-get install postgresql")
    bindir = os.path.dirname(found[-1])
    folder = tempfile.mkdtemp(prefix="crowdtrain-pg-")
    shutil.chown(folder, "postgres")
    port = _free_port()
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*as_postgres, f"{bindir}/initdb", "-D", f"{folder}/data", "-A", "trust", "-U", "postgres"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run([*as_postgres, f"{bindir}/pg_ctl", "-D", f"{folder}/data", "-l", f"{folder}/log", "-o",
                    f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start"], check=True)  # fmt: skip
    own = f"postgres://postgres@127.0.0.1:{port}/postgres"
    _wait(own, port, "PostgreSQL")
    print(f"services: started a private PostgreSQL at {own}", file=sys.stderr)
    return own


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    env = dict(os.environ)
    env["DATABASE_URL"] = ensure_postgres(env.get("DATABASE_URL") or DEFAULT_DATABASE_URL)
    env["REDIS_URL"] = ensure_redis(env.get("REDIS_URL") or DEFAULT_REDIS_URL)
    print(f"services: DATABASE_URL={env['DATABASE_URL']} REDIS_URL={env['REDIS_URL']}", file=sys.stderr)
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])

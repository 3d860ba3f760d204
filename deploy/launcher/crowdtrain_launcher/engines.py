"""The engines under the site (PostgreSQL, Redis, HAProxy): find running ones, or start private ones from Debian's.

``tests/services.py`` (the test suite's second pass) and ``crowdtrain_launcher.cluster``
(several site processes on one machine) both use these. Like the rest of the
launcher, this module never imports Django: it runs before any settings exist.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

HAPROXY = "/usr/sbin/haproxy"


class EngineError(RuntimeError):
    """An engine is neither running nor installable here; the message says what to install."""


def answers(url: str, default_port: int) -> bool:
    """Whether something accepts TCP connections at the URL's host and port."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_answers(url: str, default_port: int, what: str, timeout_s: float = 10.0) -> None:
    """Poll until a just-started engine accepts connections.

    Raises:
        EngineError: if nothing answers at ``url`` within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not answers(url, default_port):
        if time.monotonic() > deadline:
            raise EngineError(f"{what} started but does not answer at {url}")
        time.sleep(0.1)


# ------------------------------------------------------------------ Redis


def redis_argv(port: int, *, daemonize: bool = False) -> list[str]:
    """A private Redis on loopback that keeps nothing on disk (the site's Redis state is all rebuildable).

    Raises:
        EngineError: if redis-server is not installed.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise EngineError("redis-server is not installed: apt-get install redis-server")
    return [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "yes" if daemonize else "no",
    ]


def ensure_redis(url: str) -> str:
    """``url`` if Redis answers there, else the URL of a private one started in the background (left running)."""
    if answers(url, 6379):
        return url
    if shutil.which("redis-server") is None:
        raise EngineError(f"Redis does not answer at {url} and is not installed: apt-get install redis-server")
    port = free_port()
    subprocess.run(redis_argv(port, daemonize=True), check=True)
    own = f"redis://127.0.0.1:{port}/15"
    wait_until_answers(own, port, "redis-server")
    logger.info("started a private Redis at %s", own)
    return own


# ------------------------------------------------------------------ PostgreSQL


def _as_postgres() -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def init_postgres(folder: Path) -> tuple[str, Path]:
    """initdb a trust-auth cluster in ``folder/data`` (owned by the postgres user when we are root).

    Returns:
        The folder of PostgreSQL's binaries and the data directory.

    Raises:
        EngineError: if PostgreSQL is not installed.
    """
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise EngineError("PostgreSQL is not installed: apt-get install postgresql")
    bindir = os.path.dirname(found[-1])
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    data = folder / "data"
    subprocess.run(
        [*_as_postgres(), f"{bindir}/initdb", "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return bindir, data


def postgres_argv(bindir: str, data: Path, port: int) -> list[str]:
    """The server of an ``init_postgres`` cluster in the foreground, on loopback, its socket next to its data."""
    return [
        *_as_postgres(),
        f"{bindir}/postgres",
        "-D",
        str(data),
        "-p",
        str(port),
        "-k",
        str(data.parent),
        "-c",
        "listen_addresses=127.0.0.1",
    ]


def ensure_postgres(url: str) -> str:
    """``url`` if PostgreSQL answers there, else the URL of a private one started in the background (left running)."""
    if answers(url, 5432):
        return url
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        raise EngineError(f"PostgreSQL does not answer at {url} and is not installed: apt-get install postgresql")
    folder = Path(tempfile.mkdtemp(prefix="crowdtrain-pg-"))
    bindir, data = init_postgres(folder)
    port = free_port()
    subprocess.run(
        [
            *_as_postgres(),
            f"{bindir}/pg_ctl",
            "-D",
            str(data),
            "-l",
            str(folder / "log"),
            "-o",
            f"-p {port} -k {folder} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
    )
    own = f"postgres://postgres@127.0.0.1:{port}/postgres"
    wait_until_answers(own, port, "PostgreSQL")
    logger.info("started a private PostgreSQL at %s", own)
    return own


def with_database(url: str, name: str) -> str:
    """The same server, another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def create_database(url: str) -> bool:
    """Create the database ``url`` names unless it exists (connecting to the server's ``postgres`` database).

    Returns:
        Whether it was created.
    """
    import psycopg  # the site's driver; imported here so the launcher's users need not have it

    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
    return True


def drop_database(url: str) -> None:
    """Drop the database ``url`` names, closing whatever still uses it."""
    import psycopg

    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------ HAProxy


def find_haproxy() -> str:
    """The path of Debian's haproxy.

    Raises:
        EngineError: if it is not installed (``make test`` installs it).
    """
    binary = shutil.which("haproxy") or (HAPROXY if os.access(HAPROXY, os.X_OK) else None)
    if binary is None:
        raise EngineError(
            "haproxy is not installed; the cluster puts it in front of its site processes: "
            "apt-get install -y --no-install-recommends haproxy (make test does this)"
        )
    return binary

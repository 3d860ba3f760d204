"""Several site processes behind one address on one machine, without Docker: deploy/compose.yaml's topology.

    python -m crowdtrain_launcher.cluster           # 2 site processes behind https://127.0.0.1:8443/
    python -m crowdtrain_launcher.cluster --sites 3 --aggregators 2 --port 9443
    make cluster ARGS="--sites 3"

PostgreSQL and Redis are the ones at DATABASE_URL and REDIS_URL (defaults: this
machine's, database ``crowdtrain``), or private ones started from the Debian
packages when none answers. In front of N daphne processes on free loopback ports
sits HAProxy, ending TLS with a self-signed certificate made for 127.0.0.1 (or
``--cert``); behind them run a committer (it writes the steps the sites fill),
one Celery worker, Celery beat and the aggregators.
The sites run with production settings (``manage.py check --deploy`` is clean):
DEBUG off, a secret key kept in the run folder, secure cookies, HSTS, HTTPS
redirects, the proxy's X-Forwarded-For and X-Forwarded-Proto trusted. Everything
stays up until Ctrl-C, then stops in order: aggregators, sites and Celery, HAProxy,
then any private engine. Like the rest of the launcher, this module never imports Django.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import secrets
import socket
import ssl
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from . import engines
from .swarm import REPO_ROOT, WORKER_READY, Child, LaunchError, Site, Swarm

logger = logging.getLogger(__name__)

HAPROXY_TEMPLATE = REPO_ROOT / "deploy" / "haproxy.cfg.template"
COMPOSE_HAPROXY = REPO_ROOT / "deploy" / "haproxy.cfg"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/crowdtrain"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PORT = 8443
COMPOSE_SITE_SLOTS = 16  # the most site replicas deploy/haproxy.cfg balances across
# Variables the caller's environment may set for the sites instead of the cluster's choice; the
# others describe the topology itself (which engines, which proxy) and are always the cluster's.
OVERRIDABLE = (
    "CROWDTRAIN_SECRET_KEY",
    "CROWDTRAIN_ALLOWED_HOSTS",
    "CROWDTRAIN_EMAIL_URL",
    "CROWDTRAIN_HSTS_SECONDS",
    "CROWDTRAIN_HSTS_INCLUDE_SUBDOMAINS",
    "CROWDTRAIN_HSTS_PRELOAD",
)


def render_haproxy_config(
    *,
    binds: Sequence[str],
    servers: Sequence[str],
    health_host: str,
    server_options: str = "",
    resolvers: str = "",
    stats_socket: Path | None = None,
) -> str:
    """deploy/haproxy.cfg.template filled in.

    Args:
        binds: ``bind`` lines' arguments, e.g. ``127.0.0.1:8443 ssl crt /path/site.pem``.
        servers: ``server`` (or ``server-template``) lines, one per daphne process (or per group).
        health_host: the Host header of health checks; the site answers only its ALLOWED_HOSTS.
        server_options: appended to ``default-server`` (compose: re-resolve container names).
        resolvers: extra sections (compose: Docker's DNS).
        stats_socket: where HAProxy answers ``show stat`` (the launcher asks it whether every site is up).
    """
    template = string.Template(HAPROXY_TEMPLATE.read_text())
    return template.substitute(
        binds="\n".join(f"    bind {bind}" for bind in binds),
        servers="\n".join(f"    {line}" for line in servers),
        health_host=health_host,
        server_options=f" {server_options}" if server_options else "",
        resolvers=f"\n{resolvers.strip()}\n" if resolvers else "",
        global_options=f"\n    stats socket {stats_socket} mode 600 level user" if stats_socket else "",
    )


def balancer_server_states(stats_socket: Path, backend: str = "sites") -> dict[str, str]:
    """Each server of ``backend`` and its state as HAProxy sees it ("UP", "DOWN", "UP 1/2"...), from ``show stat``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5.0)
        conn.connect(str(stats_socket))
        conn.sendall(b"show stat\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    text = b"".join(chunks).decode().removeprefix("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {
        row["svname"]: row["status"]
        for row in rows
        if row.get("pxname") == backend and row.get("svname") not in ("FRONTEND", "BACKEND")
    }


def compose_haproxy_config(cert_dir: str = "/usr/local/etc/haproxy/certs/") -> str:
    """The configuration deploy/compose.yaml mounts: the ``site`` service's replicas, TLS from a folder of PEMs."""
    return render_haproxy_config(
        binds=[":80", f":443 ssl crt {cert_dir} alpn h2,http/1.1"],
        # Up to COMPOSE_SITE_SLOTS replicas of the `site` service (`up --scale site=N`): Docker's DNS
        # answers the service name with every replica's address, and HAProxy fills one slot per address.
        servers=[f"server-template site- {COMPOSE_SITE_SLOTS} site:8000"],
        # HAProxy expands environment variables in double quotes: compose passes the site's public name.
        health_host='"${CROWDTRAIN_PUBLIC_HOST}"',
        # Replicas come and go and get new addresses when they restart: ask Docker's DNS again and
        # again, and start even while no site container is up yet.
        server_options="resolvers docker init-addr none",
        resolvers="\n    ".join(
            ["resolvers docker", "nameserver dns 127.0.0.11:53", "accepted_payload_size 8192", "hold valid 10s"]
        ),
    )


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, made once per run folder with openssl.

    Returns:
        The certificate (what clients trust: SSL_CERT_FILE) and HAProxy's PEM (certificate and key).

    Raises:
        LaunchError: if openssl fails.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cert, key, pem = folder / "cert.pem", folder / "key.pem", folder / "site.pem"
    if not pem.exists():
        result = subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "825",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise LaunchError(f"openssl could not make a certificate for the balancer:\n{result.stderr[-2000:]}")
        _write_private(pem, cert.read_text() + key.read_text())
    return cert, pem


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, from its first byte (keys, secrets)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
        file.write(text)


def _secret_key(path: Path) -> str:
    """One random key per run folder, kept so that a restart keeps volunteers' sessions."""
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(50))
    return path.read_text().strip()


@dataclass
class Cluster:
    """Start and stop the several-site topology on one machine; ``start`` returns the public URL.

    Args:
        run_dir: logs, the certificate, the secret key, media and static files, a private
            PostgreSQL's data; kept between runs, like the database.
        database_url: PostgreSQL to use, or to replace with a private one if nothing answers there.
        redis_url: Redis likewise.
        sites: how many daphne processes.
        port: the balancer's HTTPS port on 127.0.0.1; 0 picks a free one.
        cert: HAProxy's PEM (certificate and key); None makes a self-signed one.
        env: more variables for every process (the caller's environment is inherited too).
    """

    run_dir: Path
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = DEFAULT_REDIS_URL
    sites: int = 2
    port: int = DEFAULT_PORT
    cert: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sites < 1:
            raise ValueError(f"a cluster needs at least one site process, got sites={self.sites}")
        self.run_dir = Path(self.run_dir).resolve()
        # Not isolated: the sites must see DATABASE_URL and REDIS_URL, set below to the engines in use.
        self.swarm = Swarm(self.run_dir, isolated=False)
        self.site_processes: list[Site] = []
        self.balancer: Child | None = None
        self.committer: Child | None = None
        self.committer_metrics_port = 0  # where the committer serves /metrics, once started
        self.client_cert: Path | None = None
        self.url = ""

    # ------------------------------------------------------------ start

    def prepare(self) -> None:
        """Engines, the database, production settings, migrations and static files: all that precedes the sites.

        Raises:
            LaunchError: if an engine cannot be had, or the settings fail ``check --deploy``.
        """
        try:
            self.database_url = self._postgres(self.database_url)
            self.redis_url = self._redis(self.redis_url)
            engines.create_database(self.database_url)
        except engines.EngineError as exc:
            raise LaunchError(str(exc)) from None
        if self.port == 0:
            self.port = engines.free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        if self.cert is None:
            self.client_cert, self.cert = self_signed_certificate(self.run_dir / "tls")
        self.swarm.env.update(self.site_env())
        _write_private(self.run_dir / "site.env", "".join(f"{k}={v}\n" for k, v in sorted(self.swarm.env.items())))
        # Django start-ups at once: the checks, collectstatic and the agent wheel need no migrated database.
        with ThreadPoolExecutor(4) as pool:
            jobs = [
                pool.submit(self.swarm.manage, *args, timeout_s=300)
                for args in (
                    ("migrate", "--noinput"),
                    ("check", "--deploy", "--fail-level", "WARNING"),
                    ("collectstatic", "--noinput", "--verbosity", "0"),
                    ("build_agent_wheel",),  # what the join pages tell volunteers to pip install
                )
            ]
            for job in jobs:
                job.result()

    def site_env(self) -> dict[str, str]:
        """The production settings every site process, Celery and manage.py get."""
        var = self.run_dir / "var"
        chosen = {
            "CROWDTRAIN_SECRET_KEY": _secret_key(self.run_dir / "secret_key"),
            "CROWDTRAIN_ALLOWED_HOSTS": "127.0.0.1,localhost",
            # Mail lands as files in var/mail/ of the run folder (no path: the settings' default folder);
            # there is no mail server on this machine to trust.
            "CROWDTRAIN_EMAIL_URL": "file://",
            # Browsers never apply HSTS to an IP address or over an untrusted certificate, so this
            # changes nothing for 127.0.0.1 and keeps the settings those of a real deployment.
            "CROWDTRAIN_HSTS_SECONDS": "3600",
            "CROWDTRAIN_HSTS_INCLUDE_SUBDOMAINS": "true",
            "CROWDTRAIN_HSTS_PRELOAD": "true",
        }
        chosen.update({name: os.environ[name] for name in OVERRIDABLE if name in os.environ})
        return {
            **chosen,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": self.redis_url,
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "CROWDTRAIN_DEBUG": "false",
            "CROWDTRAIN_VAR_DIR": str(var),
            # One folder for every process on this machine; several machines need CROWDTRAIN_S3_BUCKET.
            "CROWDTRAIN_MEDIA_ROOT": str(var / "media"),
            "CROWDTRAIN_TRUSTED_PROXY_COUNT": "1",
            "CROWDTRAIN_TRUST_FORWARDED_PROTO": "true",
            "CROWDTRAIN_SECURE_SSL_REDIRECT": "true",
            **self.env,
        }

    def start(self, *, timeout_s: float = 60.0) -> str:
        """The site processes, a committer, one Celery worker and beat, and HAProxy in front; ``prepare`` first.

        Returns:
            The public URL, once a request through the balancer has been answered.
        """
        if not self.url:
            self.prepare()
        worker = self.swarm.start_worker(beat=False, wait=False)
        self.swarm.start_beat()
        self.site_processes = self.swarm.start_sites(self.sites, timeout_s=timeout_s)
        self.committer_metrics_port = engines.free_port()
        self.committer = self.swarm.start_committer(timeout_s=timeout_s, metrics_port=self.committer_metrics_port)
        self.balancer = self._start_balancer()
        self._wait_for_public(timeout_s)
        self._wait_for_every_site_up(timeout_s)
        worker.wait_for_line(WORKER_READY, timeout_s)
        logger.info("%d site processes behind %s", self.sites, self.url)
        return self.url

    @property
    def public_site(self) -> Site:
        """The balancer as a Site, for ``Swarm.start_aggregators`` and ``start_agent``."""
        if self.balancer is None:
            raise LaunchError("start() the cluster first")
        return Site(self.url, self.balancer)

    def client_env(self) -> dict[str, str]:
        """What an aggregator or agent needs to trust a self-signed balancer (none for a real certificate)."""
        return {"SSL_CERT_FILE": str(self.client_cert)} if self.client_cert else {}

    def start_aggregators(self, tokens: Mapping[str, str], *, timeout_s: float = 60.0) -> list[str]:
        """Aggregators that reach the site through the balancer, like agents."""
        return self.swarm.start_aggregators(self.public_site, tokens, env=self.client_env(), timeout_s=timeout_s)

    def start_agent(self, *, token: str, name: str, campaign_id: int | None = None) -> Child:
        """A one-thread CPU agent that talks to the site through the balancer."""
        return self.swarm.start_agent(
            self.public_site, token=token, name=name, campaign_id=campaign_id, env=self.client_env()
        )

    def _postgres(self, url: str) -> str:
        if engines.answers(url, 5432):
            return url
        folder = self.run_dir / "postgres"
        if (folder / "data" / "PG_VERSION").exists():
            bindir = str(max(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)))
            data = folder / "data"
        else:
            bindir, data = engines.init_postgres(folder)
        port = engines.free_port()
        self.swarm.start("postgres", engines.postgres_argv(bindir, data, port), role="engine")
        own = engines.with_database(f"postgres://postgres@127.0.0.1:{port}/", urlsplit(url).path.lstrip("/"))
        engines.wait_until_answers(own, port, "PostgreSQL", timeout_s=30)
        logger.info("nothing answers at %s: started a private PostgreSQL at %s", url, own)
        return own

    def _redis(self, url: str) -> str:
        if engines.answers(url, 6379):
            return url
        port = engines.free_port()
        self.swarm.start("redis", engines.redis_argv(port), role="engine")
        own = f"redis://127.0.0.1:{port}/0"
        engines.wait_until_answers(own, port, "redis-server")
        logger.info("nothing answers at %s: started a private Redis at %s", url, own)
        return own

    def _start_balancer(self) -> Child:
        try:
            haproxy = engines.find_haproxy()
        except engines.EngineError as exc:
            raise LaunchError(str(exc)) from None
        config = self.run_dir / "haproxy.cfg"
        config.write_text(
            render_haproxy_config(
                binds=[f"127.0.0.1:{self.port} ssl crt {self.cert} alpn h2,http/1.1"],
                servers=[f"server {s.child.name} {s.url.removeprefix('http://')}" for s in self.site_processes],
                health_host="127.0.0.1",
                stats_socket=self.stats_socket,
            )
        )
        checked = subprocess.run([haproxy, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise LaunchError(f"haproxy rejects {config}:\n{(checked.stdout + checked.stderr)[-3000:]}")
        # -db: in the foreground, so it is our child and stops with the cluster.
        return self.swarm.start("haproxy", [haproxy, "-db", "-f", str(config)], role="balancer")

    def _wait_for_public(self, timeout_s: float) -> None:
        """Until GET /livez through the balancer answers 200: TLS, routing and a site process all work.

        Not /healthz: it is 503 while a running campaign waits for the aggregators this launcher starts next.
        """
        context = ssl.create_default_context(cafile=str(self.client_cert) if self.client_cert else None)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while True:
            self.swarm.check()
            try:
                with urllib.request.urlopen(f"{self.url}/livez", timeout=5, context=context) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = exc
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.url}/livez did not answer within {timeout_s:.0f} s ({last}); "
                    f"see {self.swarm.logs}/haproxy.log"
                )
            time.sleep(0.2)

    @property
    def stats_socket(self) -> Path:
        return self.run_dir / "haproxy.sock"

    def _wait_for_every_site_up(self, timeout_s: float) -> None:
        """Until the balancer counts every site process as up.

        /livez through the balancer proves one is. A process whose first health checks were slow (a
        loaded machine, a cold start) is out of the rotation for a few seconds more, and the agents
        that connect meanwhile would all land on the others and stay there: their WebSockets last
        for hours.
        """
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while True:
            self.swarm.check()
            try:
                states = balancer_server_states(self.stats_socket)
            except OSError as exc:
                states = {"(stats socket)": str(exc)}
            if states and all(state.startswith("UP") for state in states.values()):
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the balancer did not count every site process as up within {timeout_s:.0f} s: {states}; "
                    f"see {self.swarm.logs}/haproxy.log and the site logs"
                )
            time.sleep(0.2)

    # ------------------------------------------------------------ stop

    def stop_site(self, index: int, grace_s: float = 5.0) -> Site:
        """Stop site process ``index`` (from 1) as an operator would, leaving the rest running."""
        site = self.site_processes[index - 1]
        site.child.expected_exit = True  # Swarm.check must not read this as a crash
        site.child.stop(grace_s)
        logger.info("stopped %s", site.child.name)
        return site

    def stop(self, grace_s: float = 10.0) -> None:
        """Everything, in order (see swarm.ORDER); idempotent."""
        self.swarm.stop(grace_s)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _create_backbone_tokens(cluster: Cluster, names: Sequence[str]) -> dict[str, str]:
    # --rotate: the same name keeps its slices across runs, with a fresh token each time.
    return {name: cluster.swarm.manage("create_backbone_token", "--name", name, "--rotate").strip() for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crowdtrain_launcher.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=2, help="daphne processes behind the balancer (default 2)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTPS port (default {DEFAULT_PORT})")
    parser.add_argument("--aggregators", type=int, default=1, help="aggregators to start (default 1)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "var" / "cluster", help="default var/cluster")
    parser.add_argument("--cert", type=Path, help="HAProxy's PEM, certificate and key (default: a self-signed one)")
    parser.add_argument(
        "--print-compose-haproxy",
        action="store_true",
        help="print deploy/haproxy.cfg as rendered for compose.yaml and exit",
    )
    args = parser.parse_args(argv)
    if args.sites < 1 or args.aggregators < 0:
        parser.error(f"--sites must be at least 1 and --aggregators at least 0, got {args.sites}, {args.aggregators}")
    if args.print_compose_haproxy:
        sys.stdout.write(compose_haproxy_config())
        return 0
    logging.basicConfig(level=logging.INFO, format="cluster: %(message)s")
    cluster = Cluster(
        args.run_dir,
        database_url=os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL,
        redis_url=os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL,
        sites=args.sites,
        port=args.port,
        cert=args.cert,
    )
    try:
        with cluster:
            url = cluster.start()
            names = [f"agg-{i}" for i in range(1, args.aggregators + 1)]
            cluster.start_aggregators(_create_backbone_tokens(cluster, names))
            print(f"cluster: {url}/ ({args.sites} site processes behind HAProxy, {len(names)} aggregator(s))")
            print(
                f"cluster: logs in {cluster.swarm.logs}; manage.py with these settings: "
                f"set -a; . {cluster.run_dir / 'site.env'}; python manage.py createsuperuser"
            )
            print("cluster: Ctrl-C stops everything", flush=True)
            while True:
                cluster.swarm.check()
                time.sleep(1.0)
    except KeyboardInterrupt:
        print("cluster: stopped")
        return 0
    except LaunchError as exc:
        print(f"cluster: {exc}\n(all logs: {cluster.swarm.logs})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

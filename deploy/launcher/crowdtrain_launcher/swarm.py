"""Process supervision for local swarms: the site on daphne, aggregators and agents as child processes.

The demo, the end-to-end tests and the benchmark all run the real programs
on loopback the way an operator would, so they share this one launcher::

    with Swarm(Path("var/demo/run")) as swarm:
        site = swarm.start_site(env={"CROWDTRAIN_LEASE_TARGET_S": "2"})
        swarm.start_aggregator(site, token=agg_token, name="agg-1")
        swarm.start_agent(site, token=agent_token, cpus=[0])
        ...                       # poll site.url + "/api/campaigns/1/progress"
    # leaving the block stops agents, then aggregators, then the site

Every child gets its own log file under ``run_dir/logs`` (stdout and stderr
together) and its own process group, so a terminal's Ctrl-C reaches only the
parent, which then stops the children in order: agents first (they hand back
their leases), then aggregators, then the site (it must see them go), and last
what ``crowdtrain_launcher.cluster`` puts around several site processes (the
balancer, then the engines). This module never imports Django, so benchmarks can
use it before settings exist.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]  # deploy/launcher/crowdtrain_launcher/swarm.py
PYTHONPATH = [REPO_ROOT / "platform", REPO_ROOT / "agent" / "src", REPO_ROOT]

DAPHNE_LISTENING = re.compile(r"Listening on TCP address ([\d.]+):(\d+)")
BACKBONE_LISTENING = re.compile(r"crowdtrain-backbone: listening on (http://\S+)")
WORKER_READY = re.compile(r"celery@\S+ ready")
COMMITTER_READY = re.compile(r"committer \S+: waiting for full steps")


# Stop order: lower first. Agents give leases back, aggregators drain, then the site (and its Celery),
# then the balancer in front of several site processes, and last the engines under them (PostgreSQL, Redis).
ORDER = {"agent": 0, "aggregator": 1, "site": 2, "balancer": 3, "engine": 4, "other": 1}
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A child process failed to start, or died; the message names it and points at its log."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: children rely on the orderly stop alone
        return None


# Looked up once here, not in the child: between fork and exec only async-signal-safe work is wise.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """Run in the child before exec: SIGTERM it if the parent dies.

    PDEATHSIG survives ``exec`` (also through ``taskset``) and fires when the thread that
    started the child ends, so start children from the main thread. A killed test
    run or a demo killed with SIGKILL leaves no daphne behind on Linux.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# Variables that would point a local run at shared services (CI exports a PostgreSQL DATABASE_URL):
# an isolated swarm drops them, so its children use the embedded defaults in their own var folder.
SHARED_SERVICE_VARS = (
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CROWDTRAIN_SCHEDULER_REDIS_URL",
    "CELERY_TASK_ALWAYS_EAGER",
    "CROWDTRAIN_MEDIA_ROOT",
)


def child_env(
    extra: Mapping[str, str] | None = None, *, threads: int | None = None, isolated: bool = True
) -> dict[str, str]:
    """The environment every child gets: our import paths, unbuffered output, optional thread caps."""
    env = dict(os.environ)
    if isolated:
        for name in SHARED_SERVICE_VARS:
            env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in PYTHONPATH), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("DJANGO_SETTINGS_MODULE", "crowdtrain.settings")
    env["PYTHONUNBUFFERED"] = "1"  # log files fill as things happen, and ready lines are seen at once
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
    env.update(extra or {})
    return env


def pinned(argv: Sequence[str], cpus: Sequence[int] | None) -> list[str]:
    """Prefix ``taskset -c`` when CPUs are given and taskset exists (it execs, so the pid stays the same)."""
    if not cpus:
        return list(argv)
    taskset = shutil.which("taskset")
    if taskset is None:
        logger.warning("taskset not found; running %s unpinned", argv[0])
        return list(argv)
    return [taskset, "-c", ",".join(str(c) for c in cpus), *argv]


@dataclass
class Child:
    """One supervised process and its log file."""

    name: str
    role: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    expected_exit: bool = False  # True for agents run with --max-leases
    log_offset: int = 0  # where this run's output starts: logs of a kept run folder are appended to

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)

    def wait_for_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """Wait until the log shows a line matching ``pattern``.

        Raises:
            LaunchError: if the process exits first or the line does not come in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.log_path.open("rb") as log:
                    log.seek(self.log_offset)
                    text = log.read().decode(errors="replace")
            except OSError:
                text = ""
            match = pattern.search(text)
            if match:
                return match
            if not self.alive():
                raise LaunchError(
                    f"{self.name} exited with code {self.popen.returncode} before it was ready; "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{self.name} printed no line matching {pattern.pattern!r} within {timeout_s:.0f} s; "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # the child leads its own group (setsid)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL, waiting ``grace_s`` after each of the first two."""
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not self.alive():
                break
            self.signal(sig)
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                logger.info("%s did not stop on %s within %.0f s", self.name, signal.Signals(sig).name, wait_s)
        return self.popen.poll()


@dataclass(frozen=True)
class Site:
    """A running site: base URL without a trailing slash."""

    url: str
    child: Child

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Swarm:
    """Start, watch and stop the processes of one local run; a context manager.

    Args:
        run_dir: holds ``logs/`` (one file per child) and whatever the caller puts there.
        env: variables every child gets on top of this process's environment
            (typically ``CROWDTRAIN_VAR_DIR``, so children share one SQLite file).
        python: the interpreter for children; the current one by default.
        isolated: drop DATABASE_URL, REDIS_URL and friends from the children's
            environment, so they run on SQLite and in-process Celery under ``env``'s var folder.
    """

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    isolated: bool = True
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ start

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        role: str = "other",
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        threads: int | None = None,
        expected_exit: bool = False,
    ) -> Child:
        """Start one child with its output going to ``logs/<name>.log``."""
        log_path = self.logs / f"{name}.log"
        command = pinned(argv, cpus)
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            offset = log.tell()
            popen = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env({**self.env, **(env or {})}, threads=threads, isolated=self.isolated),
                # Own session: a terminal's Ctrl-C reaches only us, and we stop the children in order.
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, role, popen, log_path, time.monotonic(), expected_exit, offset)
        self.children.append(child)
        logger.info("started %s (pid %s), log %s", name, popen.pid, log_path)
        return child

    def manage(self, *args: str, timeout_s: float = 120.0, env: Mapping[str, str] | None = None) -> str:
        """Run ``manage.py ARGS`` to completion with the swarm's environment and return its stdout.

        Raises:
            LaunchError: if it fails; the message carries its stderr.
        """
        result = subprocess.run(
            [self.python, str(REPO_ROOT / "manage.py"), *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            env=child_env({**self.env, **(env or {})}, isolated=self.isolated),
            timeout=timeout_s,
        )
        if result.returncode != 0:
            raise LaunchError(f"manage.py {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def start_site(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        timeout_s: float = 60.0,
        name: str = "site",
        worker: bool = True,
    ) -> Site:
        """Start daphne with the site's ASGI app and wait for its port.

        daphne's default 1 MiB WebSocket limits stay: every protocol message
        is smaller (gradients go to aggregators, not through the site). Its
        keepalive and housekeeping are ``crowdtrain.lib.daphne_site``'s.

        Args:
            name: the child's name and log file; a second site process needs another.
            worker: also start the Celery worker when tasks go to a broker. One worker
                serves every site process of a swarm (it runs beat too, and two beats
                would schedule every periodic task twice), so pass False for the others.
        """
        child = self.start(name, self._daphne_argv(host, port), role="site", env=env, cpus=cpus)
        if worker and self.needs_worker(env):
            self.start_worker(env=env, cpus=cpus, timeout_s=timeout_s)
        return self._listening(child, timeout_s)

    def start_sites(
        self,
        count: int,
        *,
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        timeout_s: float = 60.0,
    ) -> list[Site]:
        """Start ``count`` daphne processes ``site-1`` ... on free loopback ports at once, then wait for each.

        These are the site processes behind a balancer: no Celery worker comes with them (start one
        with ``start_worker`` for all of them), and each writes daphne's access log to
        ``logs/<name>.access.log``, which shows the WebSocket connections it served.
        """
        children = [
            self.start(
                f"site-{i}",
                [*self._daphne_argv("127.0.0.1", 0), "--access-log", str(self.logs / f"site-{i}.access.log")],
                role="site",
                env=env,
                cpus=cpus,
            )
            for i in range(1, count + 1)
        ]
        return [self._listening(child, timeout_s) for child in children]

    def _daphne_argv(self, host: str, port: int) -> list[str]:
        return [self.python, "-m", "crowdtrain.lib.daphne_site", "-b", host, "-p", str(port)]

    @staticmethod
    def _listening(child: Child, timeout_s: float) -> Site:
        match = child.wait_for_line(DAPHNE_LISTENING, timeout_s)
        return Site(f"http://{match.group(1)}:{match.group(2)}", child)

    def needs_worker(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether the site's Celery tasks go to a broker (REDIS_URL set, not forced eager) instead of in-process."""
        merged = child_env({**self.env, **(env or {})}, isolated=self.isolated)
        eager = merged.get("CELERY_TASK_ALWAYS_EAGER", "").strip().lower() in ("1", "true", "yes", "on")
        return bool(merged.get("REDIS_URL")) and not eager

    def start_worker(
        self,
        *,
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        timeout_s: float = 60.0,
        beat: bool = True,
        wait: bool = True,
    ) -> Child:
        """Start a Celery worker for the site's broker (one process: these are short tasks).

        Args:
            beat: run the periodic tasks in the worker too; a deployment with its own
                ``start_beat`` process passes False (there must be exactly one beat).
            wait: return only once the worker says it is ready.
        """
        argv = [
            self.python,
            "-m",
            "celery",
            "-A",
            "crowdtrain",
            "worker",
            "--pool",
            "solo",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
        ]
        if beat:
            argv += ["--beat", "--schedule", str(self.run_dir / "celerybeat-schedule")]
        child = self.start("worker", argv, role="site", env=env, cpus=cpus)
        if wait:
            child.wait_for_line(WORKER_READY, timeout_s)
        return child

    def start_committer(
        self,
        *,
        name: str = "committer",
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        timeout_s: float = 60.0,
        metrics_port: int = 0,
    ) -> Child:
        """Start a committer (``manage.py run_committer``): it writes the steps the site processes fill.

        ``metrics_port``: where it serves its Prometheus metrics (0: nowhere). Returns once it waits for
        work, so the sites hand it the very next full step.
        """
        argv = [self.python, str(REPO_ROOT / "manage.py"), "run_committer", "--name", name]
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
        child = self.start(name, argv, role="site", env=env, cpus=cpus)
        child.wait_for_line(COMMITTER_READY, timeout_s)
        return child

    def start_beat(self, *, env: Mapping[str, str] | None = None, cpus: Sequence[int] | None = None) -> Child:
        """Start Celery beat on its own: it queues the periodic tasks (lease expiry) for whichever worker is free."""
        argv = [
            self.python,
            "-m",
            "celery",
            "-A",
            "crowdtrain",
            "beat",
            "--loglevel",
            "INFO",
            "--schedule",
            str(self.run_dir / "celerybeat-schedule"),
        ]
        return self.start("beat", argv, role="site", env=env, cpus=cpus)

    def start_aggregator(
        self,
        site: Site,
        *,
        token: str,
        name: str,
        cpus: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> str:
        """Start ``python -m crowdtrain_backbone`` on a free loopback port; returns its base URL."""
        return self.start_aggregators(site, {name: token}, cpus=cpus, env=env, timeout_s=timeout_s, host=host)[0]

    def start_aggregators(
        self,
        site: Site,
        tokens: Mapping[str, str],
        *,
        cpus: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> list[str]:
        """Start one aggregator per (name, token) at once, then wait for each; returns their base URLs.

        Each checkpoints to ``run_dir/checkpoints/<name>``. ``host`` is the address it binds and
        advertises to agents: the home-link benchmark gives agents an address of their own on loopback
        (127.0.0.2), so that only their traffic crosses its shaped link.
        """
        children = []
        for name, token in tokens.items():
            argv = [
                self.python,
                "-m",
                "crowdtrain_backbone",
                "--site",
                site.url,
                "--name",
                name,
                "--host",
                host,
                "--port",
                "0",
                "--checkpoint-dir",
                str(self.run_dir / "checkpoints" / name),
                "--spool-dir",
                str(self.run_dir / "spool" / name),
            ]
            # Tokens travel in the environment: argv is visible to every user in `ps`.
            child_vars = {"CROWDTRAIN_BACKBONE_TOKEN": token, **(env or {})}
            children.append(self.start(name, argv, role="aggregator", env=child_vars, cpus=cpus))
        return [child.wait_for_line(BACKBONE_LISTENING, timeout_s).group(1) for child in children]

    def start_agent(
        self,
        site: Site,
        *,
        token: str,
        name: str | None = None,
        threads: int = 1,
        campaign_id: int | None = None,
        max_leases: int | None = None,
        cpus: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        device: str = "cpu",
    ) -> Child:
        """Start an agent on ``device`` with ``threads`` torch threads (its token travels in the environment)."""
        name = name or f"agent-{sum(c.role == 'agent' for c in self.children) + 1}"
        argv = [
            self.python,
            "-m",
            "crowdtrain_agent.cli",
            "run",
            "--server",
            site.url,
            "--device",
            device,
            "--threads",
            str(threads),
            "--no-progress",
            "--cache-dir",
            str(self.run_dir / "cache" / name),
        ]
        if campaign_id is not None:
            argv += ["--campaign", str(campaign_id)]
        if max_leases is not None:
            argv += ["--max-leases", str(max_leases)]
        agent_env = {"CROWDTRAIN_AGENT_TOKEN": token, **(env or {})}
        return self.start(
            name, argv, role="agent", env=agent_env, cpus=cpus, threads=threads, expected_exit=max_leases is not None
        )

    # ------------------------------------------------------------------ watch

    def wait_until(self, ready: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.25) -> None:
        """Poll ``ready()`` until truthy; a child that dies meanwhile raises at once (``check``).

        ``ready`` may raise OSError while the site or an aggregator is still starting.

        Raises:
            RuntimeError: if ``what`` did not happen within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check()
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(poll_s)
        # The logs' folder is gone once CI's machine is: the tails say, in the failure itself, who stalled.
        tails = "".join(
            f"\n--- {child.name} ({child.log_path.name}) ends with:\n{child.log_tail(8)}" for child in self.children
        )
        raise RuntimeError(f"waited {timeout_s:.0f} s for {what}; logs in {self.logs}{tails}")

    def check(self) -> None:
        """Raise if any child that should still run has exited.

        Raises:
            LaunchError: naming the child, its exit code and the end of its log.
        """
        for child in self.children:
            if not child.alive() and not child.expected_exit:
                raise LaunchError(
                    f"{child.name} exited unexpectedly with code {child.popen.returncode}; "
                    f"its log {child.log_path} ends with:\n{child.log_tail()}"
                )

    def alive(self, role: str) -> int:
        return sum(1 for c in self.children if c.role == role and c.alive())

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child in order (agents, aggregators, site); idempotent."""
        for rank in sorted(set(ORDER.values())):
            group = [c for c in self.children if ORDER.get(c.role, 1) == rank and c.alive()]
            for child in group:  # signal the whole rank at once, then wait: stopping takes one grace period
                child.signal(signal.SIGINT)
            for child in group:
                try:
                    child.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    child.stop(grace_s=min(grace_s, 5.0))
                logger.info("%s stopped (code %s)", child.name, child.popen.poll())

    def __enter__(self) -> Swarm:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def get_json(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET a JSON document from a child (the site's progress feed, an aggregator's health)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (loopback http only)
        return json.loads(response.read())

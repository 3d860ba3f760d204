"""Train the demo campaign on this machine: the site, one aggregator and CPU agents on loopback.

    ./manage.py demo                              # until Ctrl-C
    ./manage.py demo --steps 30 --exit-when-done  # last line: demo: steps=30 loss=5.544->3.213 samples_per_s=222.7

Every run starts clean in ``var/demo/`` (the folder is wiped first): its own
SQLite file, shards, checkpoints, agent caches and one log file per process
in ``var/demo/logs/``. The folder stays after the run for a look at the logs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import urllib.error
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console
from rich.live import Live

from crowdtrain.campaigns.terminal import ProgressView
from crowdtrain_launcher import LaunchError, Site, Swarm, get_json

# A lease should take ~2 s, so every step of a few hundred samples is shared by several agents.
DEMO_SITE_ENV = {"CROWDTRAIN_LEASE_TARGET_S": "2"}
# 128 samples of 64 bytes per step: ~1.3 s a step with two one-thread agents on two cores,
# and lr 3e-3 AdamW takes the loss from ln(256) = 5.55 to below 4.5 within 30 steps.
DEMO_BATCH = 128
DEMO_MICROBATCH = 16
POLL_S = 0.5


class Command(BaseCommand):
    help = "Run the site, an aggregator and CPU agents on loopback and train the demo GPT, with live progress."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--steps", type=int, default=None, help="train this many steps (default: until Ctrl-C)")
        parser.add_argument("--exit-when-done", action="store_true", help="stop everything and exit after --steps")
        parser.add_argument("--agents", type=int, default=2, help="CPU agents to start, one torch thread each")
        parser.add_argument("--port", type=int, default=0, help="site port on 127.0.0.1 (default 0: a free one)")
        parser.add_argument("--batch", type=int, default=DEMO_BATCH, help=f"samples per step (default {DEMO_BATCH})")
        parser.add_argument("--stall-s", type=float, default=120.0, help="give up after this long without progress")

    def handle(self, *args: Any, **options: Any) -> None:
        steps: int | None = options["steps"]
        if options["exit_when_done"] and steps is None:
            raise CommandError("--exit-when-done needs --steps N (how many steps to train before exiting)")
        if (steps is not None and steps < 1) or options["agents"] < 1 or options["batch"] < DEMO_MICROBATCH:
            raise CommandError(f"--steps and --agents must be at least 1 and --batch at least {DEMO_MICROBATCH}")
        # Our own start/stop lines would scroll the live panel away; the log files have them.
        logging.getLogger("crowdtrain_launcher").setLevel(logging.WARNING)
        console = Console(stderr=False)
        run_dir = settings.VAR_DIR / "demo"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        swarm = Swarm(run_dir, env={"CROWDTRAIN_VAR_DIR": str(run_dir), **DEMO_SITE_ENV})
        self.progress: dict[str, Any] = {}
        try:
            with swarm:
                try:
                    site, campaign_id = self._start(swarm, console, options)
                    self._watch(swarm, site, campaign_id, console, options)
                except KeyboardInterrupt:
                    console.print("demo: Ctrl-C, stopping every process ...")
                # Stop before the summary, so that the summary is the last line of output.
                swarm.stop()
        except LaunchError as exc:
            raise CommandError(f"{exc}\n(all logs: {swarm.logs})") from None
        self.stdout.write(self._summary())

    def _summary(self) -> str:
        losses = self.progress.get("losses") or [float("nan")]
        return (
            f"demo: steps={self.progress.get('version', 0)} loss={losses[0]:.3f}->{losses[-1]:.3f} "
            f"samples_per_s={self.progress.get('samples_per_s', 0.0):.1f}"
        )

    def _start(self, swarm: Swarm, console: Console, options: dict[str, Any]) -> tuple[Site, int]:
        spec = {
            "campaigns": [
                {
                    "preset": "demo",
                    "max_steps": options["steps"],
                    "target_batch_size": options["batch"],
                    "microbatch_size": DEMO_MICROBATCH,
                    "lr": 3e-3,
                }
            ],
            "aggregators": ["agg-1"],
            "agents": [f"agent-{i + 1}" for i in range(options["agents"])],
        }
        spec_path = swarm.run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        with console.status("demo: creating the database and the stdlib dataset ..."):
            seed = json.loads(swarm.manage("seed_run", "--migrate", "--spec", str(spec_path)))
        with console.status("demo: starting the site and the aggregator ..."):
            site = swarm.start_site(port=options["port"])
            swarm.start_aggregator(site, token=seed["aggregators"]["agg-1"], name="agg-1")
        campaign_id = seed["campaigns"][0]
        for name, token in seed["agents"].items():
            swarm.start_agent(site, token=token, name=name, threads=1, campaign_id=campaign_id)
        console.print(f"demo: site at {site.url}/  (logs in {swarm.logs})")
        return site, campaign_id

    def _watch(self, swarm: Swarm, site: Site, campaign_id: int, console: Console, options: dict[str, Any]) -> None:
        """Redraw the panel until done (with --exit-when-done) or Ctrl-C; keeps the last progress in self."""
        steps, started = options["steps"], time.monotonic()
        last_change, last_key = started, None
        view = ProgressView(site.url, {}, steps, swarm.alive("agent"), 0.0, "starting agents ...")
        try:
            with Live(view.render(), console=console, refresh_per_second=4) as live:
                while True:
                    swarm.check()  # a dead process ends the demo with its log's last lines
                    with contextlib.suppress(urllib.error.URLError, OSError, ValueError):  # busy site: next time
                        self.progress = get_json(f"{site.url}/api/campaigns/{campaign_id}/progress")
                    key = (self.progress.get("samples"), self.progress.get("version"))
                    if key != last_key:
                        last_key, last_change = key, time.monotonic()
                    done = steps is not None and (
                        self.progress.get("state") == "finished" or self.progress.get("version", 0) >= steps
                    )
                    if not done and time.monotonic() - last_change > options["stall_s"]:
                        raise CommandError(
                            f"no progress for {options['stall_s']:.0f} s (step {self.progress.get('version', 0)}); "
                            f"look at the logs in {swarm.logs}"
                        )
                    note = "Ctrl-C stops everything"
                    if done:
                        note = "training finished; " + ("stopping" if options["exit_when_done"] else "Ctrl-C stops")
                    agents, elapsed = swarm.alive("agent"), time.monotonic() - started
                    live.update(ProgressView(site.url, self.progress, steps, agents, elapsed, note).render())
                    if done and options["exit_when_done"]:
                        return
                    time.sleep(POLL_S)
        finally:
            if not console.is_terminal:
                console.line()  # rich ends its last frame with a newline only on a terminal

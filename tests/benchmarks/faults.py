"""Faults injected from outside, with what each cost a real run: steps lost, samples lost and doubled, stalls.

    python -m tests.benchmarks.faults                                # every fault (make bench runs it)
    python -m tests.benchmarks.faults --faults aggregator --runs 12  # the rollback race, more tries

Each run is a real swarm on the embedded default (one site process on SQLite, two aggregators, two agents,
the two-slice MLP of the end-to-end tests: 96 samples a step, steps of about a tenth of a second), the
processes started and killed as an operator's mistakes or a machine's death would:

- ``aggregator``: ``kill -9`` of one aggregator mid-run (staleness 1, checkpoint every 4), restarted under
  its name at once. Its uploads are gone, so the site rolls back; a step being written meanwhile is the race
  of issue 31, which the fault injection met in about 1 run of 4.
- ``storage``: both aggregators checkpoint to S3 (moto's server, behind a TCP proxy of this bench), and
  the proxy refuses every connection for ``--outage-s`` seconds (each checkpoint then fails with
  ``EndpointConnectionError``, as with the S3 server killed). Also: the most steps committed past the newest
  complete checkpoint, against the bound (``CROWDTRAIN_CHECKPOINT_LAG_MAX`` intervals), and how long
  training took to go on once storage was back.
- ``site``: ``kill -9`` of the site on SQLite (its scheduling state lives in the process), restarted on the
  same port.

After each run: *steps lost* are committed steps a rollback undid; *doubled* counts samples in two
committed steps; *unfinished* counts samples below the newest committed sample in no committed step (the
work in flight when the run stopped shows here too, so it bounds loss from above); *replay* is the relative
error between the platform's parameters and plain PyTorch replaying exactly the committed steps ("n/a" at
staleness 1, whose delayed update a plain replay does not make); the *stall* runs from the fault (for
storage: from its return) until the run has committed more steps than it had then, so steps a rollback
undid count only once redone. Figures only, nothing asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from crowdtrain_launcher import Child, Site, Swarm
from tests.e2e.conftest import Run, seed
from tests.e2e.test_two_aggregators_match_plain_pytorch import (
    SITE_ENV,
    platform_params,
    rerun_in_pytorch,
    spec,
    write_dataset,
)
from tests.s3server import s3_server

FAULTS = ("aggregator", "storage", "site")


@dataclass
class Outcome:
    """One run's figures."""

    fault: str
    steps: int = 0
    steps_lost: int = 0
    rollbacks: int = 0
    discarded: int = 0
    doubled: int = 0
    unfinished: int = 0
    stall_s: float = float("nan")
    replay_error: float = float("nan")
    extra: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        replay = "n/a" if math.isnan(self.replay_error) else f"{self.replay_error:.2g}"
        return (
            f"bench: fault_{self.fault} steps={self.steps} steps_lost={self.steps_lost} rollbacks={self.rollbacks} "
            f"discarded_writes={self.discarded} samples_doubled={self.doubled} samples_unfinished={self.unfinished} "
            f"stall_s={self.stall_s:.1f} replay_error={replay}{extra}"
        )


class Proxy:
    """A TCP relay to ``target`` on a fixed loopback port that the bench can cut (connections refused) and mend."""

    def __init__(self, target: int) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()


def _count_samples(dump: dict[str, Any]) -> tuple[int, int]:
    """Samples in two committed steps, and samples below the newest committed one that are in none."""
    counted: Counter[tuple[str, int]] = Counter()
    for step in dump["steps"]:
        for sha, start, count in step["ranges"]:
            counted.update((sha, i) for i in range(start, start + count))
    doubled = sum(1 for n in counted.values() if n > 1)
    order = {sha: k for k, sha in enumerate(s["sha256"] for s in dump["dataset"]["shards"])}
    sizes = {s["sha256"]: s["num_samples"] for s in dump["dataset"]["shards"]}
    if not counted:
        return doubled, 0
    last = max(counted, key=lambda key: (order[key[0]], key[1]))
    below = sum(sizes[sha] for sha in sizes if order[sha] < order[last[0]]) + last[1] + 1
    return doubled, below - len(counted)


def _finish(outcome: Outcome, run: Run, steps: int, *, replay: bool = True) -> Outcome:
    dump = run.dump()
    log = (run.swarm.logs / "site.log").read_text(errors="replace")
    outcome.steps = len(dump["steps"])
    outcome.rollbacks = len(re.findall(r"rolled back to version \d+ after", log))
    outcome.discarded = len(re.findall(r"was not committed: the campaign is at step", log))
    outcome.steps_lost = _steps_undone(log)
    outcome.doubled, outcome.unfinished = _count_samples(dump)
    # Only at staleness 0: a plain replay computes every gradient on the newest parameters, which a run of
    # staleness 1 (a delayed update) does not; there the exactly-once figures stand alone.
    if replay:
        try:
            platform = platform_params(dump, steps)
            reference, _ = rerun_in_pytorch(dump, steps)
        except Exception as exc:  # a run that could not reach the version has no replay to compare
            outcome.extra["replay"] = type(exc).__name__
        else:
            outcome.replay_error = float(
                torch.linalg.vector_norm(platform - reference) / torch.linalg.vector_norm(reference)
            )
    if [s["index"] for s in dump["steps"]] != list(range(len(dump["steps"]))):
        outcome.extra["step_rows"] = "not_contiguous"
    if dump["blocked_reason"]:
        outcome.extra["blocked"] = "yes"
    return outcome


def _steps_undone(log: str) -> int:
    """Committed steps rollbacks undid: for each rollback, the newest step committed before it minus its target."""
    undone, newest = 0, -1
    for line in log.splitlines():
        committed = re.search(r"step (\d+) committed", line)
        if committed:
            newest = max(newest, int(committed.group(1)))
        back = re.search(r"rolled back to version (\d+)", line)
        if back:
            target = int(back.group(1))
            undone += max(0, newest + 1 - target)
            newest = target - 1
    return undone


def _committed(run: Run) -> int:
    try:
        return int(run.progress()["committed_steps"])
    except OSError:  # the site is restarting
        return -1


def _stall(run: Run, since: float, steps: int, timeout_s: float) -> float:
    """Watch the run from ``since`` until it has committed ``steps`` steps: the longest time it went without
    committing a step it never had before (a rollback's redone steps are not new)."""
    newest, last_new, longest = _committed(run), since, 0.0
    deadline = time.monotonic() + timeout_s
    while newest < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{newest} of {steps} steps committed after {timeout_s:.0f} s")
        run.swarm.check()
        committed = _committed(run)
        now = time.monotonic()
        if committed > newest:
            longest, newest, last_new = max(longest, now - last_new), committed, now
        time.sleep(0.1)
    return max(longest, 0.0)


def _kill_9(swarm: Swarm, child: Child) -> float:
    """``kill -9`` a child of the swarm and forget it; returns when it was killed (monotonic)."""
    child.expected_exit = True
    child.signal(signal.SIGKILL)
    killed = time.monotonic()
    child.popen.wait(15)
    swarm.children.remove(child)
    return killed


@contextlib.contextmanager
def _swarm(folder: Path, env: dict[str, str] | None = None) -> Iterator[Swarm]:
    swarm = Swarm(folder, env={"CROWDTRAIN_VAR_DIR": str(folder / "var"), **SITE_ENV, **(env or {})})
    with swarm:
        yield swarm


def _campaign(folder: Path, steps: int, staleness: int, every: int) -> dict[str, Any]:
    npz = folder / "projection.npz"
    write_dataset(npz)
    campaign_spec = spec(npz)
    campaign_spec["campaigns"][0].update(max_steps=steps, staleness=staleness, checkpoint_every=every)
    return campaign_spec


def _training(swarm: Swarm, folder: Path, steps: int, staleness: int) -> tuple[Run, Site]:
    """Seed the run's campaign (checkpoint every 4), start every process, and wait for version 10."""
    run = Run(swarm, seed(swarm, _campaign(folder, steps, staleness=staleness, every=4), folder / "spec.json"))
    site = run.start(agents_first=True)
    run.wait_for_version(10, timeout_s=90)
    return run, site


def aggregator_fault(folder: Path, steps: int) -> Outcome:
    outcome = Outcome("aggregator")
    with _swarm(folder) as swarm:
        run, site = _training(swarm, folder, steps, staleness=1)
        victim = next(c for c in swarm.children if c.name == "agg-2")
        killed = _kill_9(swarm, victim)
        swarm.start_aggregator(site, token=run.seed["aggregators"]["agg-2"], name="agg-2")
        outcome.stall_s = _stall(run, killed, steps, timeout_s=180)
        run.wait_for_version(steps, timeout_s=60)
        return _finish(outcome, run, steps, replay=False)


def storage_fault(folder: Path, steps: int, outage_s: float) -> Outcome:
    outcome = Outcome("storage")
    with s3_server(folder / "s3") as s3_env, _swarm(folder) as swarm:
        endpoint = s3_env["CROWDTRAIN_S3_ENDPOINT_URL"]
        proxy = Proxy(int(endpoint.rsplit(":", 1)[1]))
        storage = {
            **s3_env,
            "CROWDTRAIN_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
            "CROWDTRAIN_BACKBONE_CHECKPOINT_URL": f"s3://{s3_env['CROWDTRAIN_S3_BUCKET']}/checkpoints",
            "CROWDTRAIN_BACKBONE_CHECKPOINT_FALLBACK_DIR": str(folder / "fallback"),
        }
        storage.pop("CROWDTRAIN_S3_BUCKET")  # the site keeps its shards in its media folder
        run = Run(swarm, seed(swarm, _campaign(folder, steps, staleness=0, every=4), folder / "spec.json"))
        site = swarm.start_site()
        run.site = site
        for name, token in run.seed["agents"].items():
            swarm.start_agent(site, token=token, name=name, threads=1, campaign_id=run.campaign_id)
        swarm.start_aggregators(site, run.seed["aggregators"], env=storage)
        run.wait_for_version(12, timeout_s=90)

        proxy.down()
        cut = newest = _committed(run)
        last_new = time.monotonic()
        most_lag = 0
        until = time.monotonic() + outage_s
        while time.monotonic() < until:
            most_lag = max(most_lag, _lag(site.url, run.campaign_id))
            if (committed := _committed(run)) > newest:
                newest, last_new = committed, time.monotonic()
            time.sleep(0.25)
        proxy.up()
        back = time.monotonic()
        run.swarm.wait_until(lambda: _committed(run) > newest, timeout_s=120, what="a step after the outage")
        resumed = time.monotonic()
        # The stall: from the last step the bound let through to the first after storage came back.
        outcome.stall_s = max(resumed - last_new, _stall(run, resumed, steps, timeout_s=180))
        run.wait_for_version(steps, timeout_s=60)
        outcome.extra.update(
            committed_during_outage=str(newest - cut),
            most_lag_steps=str(most_lag),
            bound_steps=str(3 * 4),
            resumed_after_s=f"{resumed - back:.1f}",
        )
        finished = _finish(outcome, run, steps)
        proxy.down()
        return finished


def _lag(site_url: str, campaign_id: int) -> int:
    try:
        with urllib.request.urlopen(f"{site_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0
    found = re.search(rf'crowdtrain_campaign_checkpoint_lag_steps{{campaign="{campaign_id}"}} (\d+)', text)
    return int(float(found.group(1))) if found else 0


def site_fault(folder: Path, steps: int) -> Outcome:
    outcome = Outcome("site")
    with _swarm(folder) as swarm:
        run, site = _training(swarm, folder, steps, staleness=0)
        killed = _kill_9(swarm, site.child)
        run.site = swarm.start_site(port=site.port)
        outcome.stall_s = _stall(run, killed, steps, timeout_s=180)
        run.wait_for_version(steps, timeout_s=60)
        return _finish(outcome, run, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--runs", type=int, default=4, help="runs of the aggregator fault (the race is random)")
    parser.add_argument("--steps", type=int, default=40, help="steps each run trains")
    parser.add_argument("--outage-s", type=float, default=20.0, help="how long storage is away")
    args = parser.parse_args(argv)
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    root = Path(tempfile.mkdtemp(prefix="crowdtrain-faults-"))
    try:
        for fault in chosen:
            runs = args.runs if fault == "aggregator" else 1
            for k in range(runs):
                folder = root / f"{fault}-{k}"
                folder.mkdir()
                try:
                    if fault == "aggregator":
                        outcome = aggregator_fault(folder, args.steps)
                    elif fault == "storage":
                        outcome = storage_fault(folder, args.steps, args.outage_s)
                    else:
                        outcome = site_fault(folder, args.steps)
                except Exception as exc:  # one failed run must not hide the others' figures
                    print(f"bench: fault_{fault} run {k} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                print(outcome.line(), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

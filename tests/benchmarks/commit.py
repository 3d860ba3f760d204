"""The step-commit bench: how long a full step's write holds the commit pipeline, by step size.

    python -m tests.benchmarks.commit                              # both backends (make bench runs it)
    python -m tests.benchmarks.commit --backends redis --leases 2000,10000 --devices 1000

Why it matters: with staleness 1 the step after next waits for this write, so at 1,000 lease cycles a
second and steps of 2,000 leases the whole write must take well under the two seconds the swarm needs to
fill a step (the scale bench's ``step_publish_s_N`` measures the same pipeline end to end, with noise).

Each backend gets a database of its own in a child process (Django reads its settings once per process):

- ``embedded``: an SQLite file (``var/bench/commit/embedded.sqlite3``, deleted first) and the in-process
  Redis (fakeredis) the leaderboards use when no Redis is configured.
- ``redis``: PostgreSQL (the server of ``DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432``,
  database ``crowdtrain_bench_commit`` dropped and created) and real Redis (``REDIS_URL``, database 14,
  flushed first). Without them its figures say ``skipped``.

The seed: ``--devices`` volunteers with a device each, a running campaign. For each step size, a warm-up step
and then ``--steps`` timed steps: the step's leases are inserted first as ``active`` rows, as the site's
batched record writes them when it issues a lease, and the step's records (what the hot state holds for a
full step: ranges, loss, times, link figures) go to ``commits._write_step``, the function a site calls when
a done report fills a step. Timed: that call, from its start to its return, which includes the
transaction's commit and what runs on commit (the leaderboards' projection). Leases are spread over the
devices round-robin, so every device has work in every step.

Prints ``bench: commit_ms_<backend>_<leases>=p50 X max Y`` per step size; figures only, nothing asserted.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
for _folder in (
    REPO_ROOT / "platform",
    REPO_ROOT / "agent" / "src",
    REPO_ROOT / "deploy" / "launcher",
):  # as manage.py does
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from .databases import flush_redis, recreate_database, with_database  # noqa: E402
from .figures import skipped_line  # noqa: E402

BACKENDS = ("embedded", "redis")
BENCH_DIR = REPO_ROOT / "var" / "bench" / "commit"
DATABASE_NAME = "crowdtrain_bench_commit"
DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
REDIS_DB = 14  # scale.py has 12, the leaderboard bench 13, the test suite 15
MICROBATCH = 4  # samples per lease


def _child_env(backend: str) -> dict[str, str]:
    """The environment of the child that times one backend; raises OSError when its services are down."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CROWDTRAIN_SCHEDULER_REDIS_URL")}
    env["DJANGO_SETTINGS_MODULE"] = "crowdtrain.settings"
    if backend == "embedded":
        database = BENCH_DIR / "embedded.sqlite3"
        for leftover in BENCH_DIR.glob("embedded.sqlite3*"):
            leftover.unlink()
        env["DATABASE_URL"] = f"sqlite:///{database}"
        return env
    server = os.environ.get("DATABASE_URL", "") or DEFAULT_POSTGRES
    redis_url = urlunsplit(urlsplit(os.environ.get("REDIS_URL", "") or DEFAULT_REDIS)._replace(path=f"/{REDIS_DB}"))
    try:
        recreate_database(server, DATABASE_NAME)
        flush_redis(redis_url)
    except Exception as exc:  # psycopg and redis each have their own connection errors
        raise OSError(f"PostgreSQL or Redis unreachable: {exc}".splitlines()[0]) from exc
    env.update(
        DATABASE_URL=with_database(server, DATABASE_NAME), REDIS_URL=redis_url, CROWDTRAIN_SCHEDULER_REDIS_URL=redis_url
    )
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks.commit",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: embedded, redis")
    parser.add_argument("--leases", default="200,2000", help="comma-separated step sizes, in leases")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per size (after one warm-up step)")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sizes = [int(s) for s in args.leases.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--leases: expected comma-separated whole numbers, got {args.leases!r}")
    if not sizes or min(sizes) < 1 or args.devices < 1 or args.steps < 1:
        parser.error("--leases, --devices and --steps must be at least 1")
    if args.child:
        return _child(args.child, sizes, args.devices, args.steps)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"--backends: unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    failed = False
    for backend in backends:
        names = [f"commit_ms_{backend}_{size}" for size in sizes]
        try:
            env = _child_env(backend)
        except OSError as exc:
            for name in names:
                print(skipped_line(name, str(exc)), flush=True)
            continue
        command = [sys.executable, "-m", "tests.benchmarks.commit", "--child", backend, "--leases", args.leases]
        command += ["--devices", str(args.devices), "--steps", str(args.steps)]
        if subprocess.run(command, cwd=REPO_ROOT, env=env, check=False).returncode != 0:
            failed = True
            for name in names:
                print(skipped_line(name, f"the {backend} run failed; its output is above"), flush=True)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- the child: seed, then time steps


def _child(backend: str, sizes: list[int], devices: int, steps: int) -> int:
    import django

    django.setup()
    from django.core.management import call_command

    started = time.monotonic()
    call_command("migrate", verbosity=0, interactive=False)
    config, device_ids = _seed(devices, max(sizes) * MICROBATCH * (steps + 1) * len(sizes))
    print(
        f"seeded {backend}: {devices:,} devices, a campaign; {time.monotonic() - started:.1f} s",
        flush=True,
    )
    index = 0
    next_lease = 1
    for size in sizes:
        timings = []
        for attempt in range(steps + 1):
            records = _records(config, device_ids, next_lease, index, size)
            next_lease += size
            seconds = _time_step(config, index, records)
            index += 1
            if attempt:  # the first of each size warms caches and plans
                timings.append(seconds * 1000)
        print(
            f"bench: commit_ms_{backend}_{size}=p50 {statistics.median(timings):.1f} max {max(timings):.1f} "
            f"({size:,} leases of {min(size, devices):,} devices a step, {steps} steps)",
            flush=True,
        )
    return 0


def _seed(devices: int, samples: int) -> tuple[Any, list[int]]:
    from django.contrib.auth import get_user_model

    from crowdtrain.accounts.models import Device, Profile
    from crowdtrain.scheduler.configs import campaign_config
    from tests.factories import make_campaign, make_text_dataset

    users = get_user_model().objects.bulk_create(
        [get_user_model()(username=f"bench-{i:06d}", password="!") for i in range(devices)], batch_size=2000
    )
    Profile.objects.bulk_create([Profile(user_id=u.pk) for u in users], batch_size=2000)
    created = Device.objects.bulk_create(
        [Device(owner_id=u.pk, name="bench", token_hash=f"{i:064x}") for i, u in enumerate(users)], batch_size=2000
    )
    dataset = make_text_dataset(num_samples=samples, sample_len=9, samples_per_shard=max(1000, samples // 50))
    campaign = make_campaign(dataset, target_batch_size=2**24, microbatch_size=MICROBATCH, staleness=1)
    config = campaign_config(campaign.pk)
    assert config is not None, "the seeded campaign has no config"
    return config, [d.pk for d in created]


def _records(config: Any, device_ids: list[int], first_id: int, step: int, size: int) -> list[dict[str, Any]]:
    """A full step's lease records as the hot state holds them, each lease's row already written as active."""
    from crowdtrain.scheduler.lease_rows import moment, to_shards
    from crowdtrain.scheduler.models import Lease

    now = time.time()
    records = []
    for i in range(size):
        lease_id = first_id + i
        start = (lease_id - 1) * MICROBATCH
        records.append(
            {
                "id": lease_id,
                "d": device_ids[i % len(device_ids)],
                "b": max(step - 1, 0),
                "r": [[0, start, MICROBATCH]],
                "n": MICROBATCH,
                "loss": 2.5 + (i % 7) / 10,
                "t0": now - 2.0,
                "t1": now - 0.1,
                "cs": 1.5,
                "dl": now + 30.0,
                "nu": 24_000,
                "nd": 24_000,
                "ns": 0.2,
            }
        )
    Lease.objects.bulk_create(
        [
            Lease(
                pk=r["id"],
                campaign_id=config.id,
                device_id=r["d"],
                base_version=r["b"],
                target_step=step,
                ranges=(ranges := to_shards(config.table, r["r"])),
                epoch=ranges[0][0],
                num_samples=r["n"],
                issued_at=moment(r["t0"]),
                deadline=moment(r["dl"]),
            )
            for r in records
        ],
        batch_size=2000,
    )
    return records


def _time_step(config: Any, index: int, records: list[dict[str, Any]]) -> float:
    import gc

    from crowdtrain.scheduler import commits
    from crowdtrain.scheduler.hotrecords import lease_record

    typed = [lease_record({"s": index, "st": "accepted", **r}) for r in records]  # as the take script answers
    gc.collect()
    started = time.perf_counter()
    lease_ids = commits._write_step(config, index, typed, line=0)  # no rollback in the bench: timeline 0
    elapsed = time.perf_counter() - started
    assert len(lease_ids) == len(records), f"step {index}: {len(lease_ids)} of {len(records)} leases written"
    return elapsed


if __name__ == "__main__":
    sys.exit(main())

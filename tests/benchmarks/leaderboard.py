"""The leaderboard bench: the page's server time with 100,000 volunteers in 5,000 teams and a year of credit.

    python -m tests.benchmarks.leaderboard                        # both backends (make bench runs it)
    python -m tests.benchmarks.leaderboard --backends embedded --volunteers 20000 --teams 1000

Each backend gets a site of its own, seeded from scratch in a child process (Django reads its settings
once per process). The children seed at once, a core each, since seeding is most of the run (about 2
minutes in all on 2 cores), then are timed one after the other, so neither times while the other works:

- ``embedded``: the default's SQLite file (``var/bench/leaderboard/embedded.sqlite3``, deleted first) and
  the in-process Redis (fakeredis) that holds the boards when no Redis is configured.
- ``redis``: PostgreSQL (the server of ``DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432``,
  database ``crowdtrain_bench_lb`` dropped and created) and real Redis (the server of ``REDIS_URL``, default
  ``redis://127.0.0.1:6379``, database 13, flushed first). Without them its figures say ``skipped``.

The seed: users and their profiles (bulk_create skips the signal that makes profiles, so the profiles are
bulk-created too), 5% anonymous, 20% in no team, and the teams. Every volunteer's year of credit goes in
through ``boards.add``, as the ledger feeds the boards, in two deltas rather than 8,760 hourly ones: the
year's share dated a year ago (all time only), and the last week's in one hourly bucket of the last 7
days, a seventh of them in the last 24 hours. So the all-time and 7-day boards hold every volunteer and the
24-hour board about 14,000. The ledger itself holds no rows (a year of them would take longer to write than
the whole bench): the page reads only the sorted sets and profiles, so the boards are marked built and
aged, as on a site that has been up, and no reader rebuilds them from the empty ledger.

Then ``--requests`` GETs of ``/leaderboards/?period=P`` per period through ``django.test.Client`` (after a
few unmeasured ones), logged in as a named volunteer about 90% of the way down the all-time board (and on
the 24-hour one), so each request also looks up the viewer's row. Timed in the process, from the client's
call to its return: the whole Django stack (session, middleware, Redis, queries, template), no network. Prints
``bench: leaderboard_ms_<backend>_<period>=p50 X p99 Y`` and one line per backend saying what was seeded;
figures only, nothing is asserted about them.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
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
from .figures import percentile, skipped_line  # noqa: E402

logger = logging.getLogger("tests.benchmarks.leaderboard")

BACKENDS = ("embedded", "redis")
PERIODS = ("24h", "7d", "all")
BENCH_DIR = REPO_ROOT / "var" / "bench" / "leaderboard"
DATABASE_NAME = "crowdtrain_bench_lb"
DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379"
REDIS_DB = 13  # scale.py has 12, the test suite 15
CAMPAIGN_ID = 1  # the boards' per-campaign scope the credit is in (the global scope is the one timed)
WARMUP_REQUESTS = 5  # per period: templates compiled, connections opened
VIEWER_DEPTH = 0.9  # how far down the all-time board the logged-in volunteer stands
HOUR = 3600
WEEK_HOURS = 24 * 7
SEEDED = "seeded "  # the child's line that says it is ready to be timed


def _figure_names(backend: str) -> list[str]:
    return [f"leaderboard_ms_{backend}_{period}" for period in PERIODS]


# ----------------------------------------------------------------------------- the parent: one site per backend


def _service_urls() -> tuple[str, str]:
    """This bench's PostgreSQL database and Redis database, on the servers the environment names."""
    database = os.environ.get("DATABASE_URL", "")
    server = database if database.startswith(("postgres://", "postgresql://")) else DEFAULT_POSTGRES
    redis_url = os.environ.get("REDIS_URL", "") or DEFAULT_REDIS
    return with_database(server, DATABASE_NAME), urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))


def _child_env(backend: str) -> dict[str, str]:
    """The environment of the child that seeds and times one backend; raises OSError when its services are down."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CROWDTRAIN_SCHEDULER_REDIS_URL")}
    env.update(
        CROWDTRAIN_VAR_DIR=str(BENCH_DIR), CROWDTRAIN_LOG_LEVEL="WARNING", DJANGO_SETTINGS_MODULE="crowdtrain.settings"
    )
    if backend == "embedded":
        database = BENCH_DIR / "embedded.sqlite3"
        for leftover in BENCH_DIR.glob("embedded.sqlite3*"):  # the file and its WAL
            leftover.unlink()
        env["DATABASE_URL"] = f"sqlite:///{database}"
        return env
    database_url, redis_url = _service_urls()
    try:
        recreate_database(database_url, DATABASE_NAME)
        flush_redis(redis_url)
    except Exception as exc:  # psycopg and redis each have their own connection errors
        raise OSError(f"PostgreSQL or Redis unreachable: {exc}".splitlines()[0]) from exc
    env.update(DATABASE_URL=database_url, REDIS_URL=redis_url, CROWDTRAIN_SCHEDULER_REDIS_URL=redis_url)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks.leaderboard",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: embedded, redis")
    parser.add_argument("--volunteers", type=int, default=100_000)
    parser.add_argument("--teams", type=int, default=5_000)
    parser.add_argument("--requests", type=int, default=100, help="timed requests per period")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.child:
        return _child(args.child, args.volunteers, args.teams, args.requests)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"--backends: unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)

    # Seeding is most of the run and one core each: the backends seed at once, then are timed one at a time.
    children: dict[str, subprocess.Popen[str]] = {}
    for backend in backends:
        try:
            env = _child_env(backend)
        except OSError as exc:
            for name in _figure_names(backend):
                print(skipped_line(name, str(exc)), flush=True)
            continue
        command = [sys.executable, "-m", "tests.benchmarks.leaderboard", "--child", backend]
        command += ["--volunteers", str(args.volunteers), "--teams", str(args.teams), "--requests", str(args.requests)]
        children[backend] = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    seeded = {backend: _relay(child, until=SEEDED) for backend, child in children.items()}
    failed = False
    for backend, child in children.items():
        if seeded[backend]:
            assert child.stdin is not None  # a pipe: Popen was given stdin=PIPE
            child.stdin.write("go\n")
            child.stdin.close()
            _relay(child)
        if child.wait() != 0:
            failed = True
            for name in _figure_names(backend):
                print(skipped_line(name, f"the {backend} run exited with {child.returncode}; its output is above"))
    if "redis" in children:
        flush_redis(_service_urls()[1])  # a few hundred MB of the machine's memory; the database is only disk
    return 1 if failed else 0


def _relay(child: subprocess.Popen[str], until: str | None = None) -> bool:
    """Copy the child's output to ours, up to a line that starts with ``until`` (True) or its end (False)."""
    assert child.stdout is not None  # a pipe: Popen was given stdout=PIPE
    for line in child.stdout:
        print(line, end="", flush=True)
        if until is not None and line.startswith(until):
            return True
    return False


# ----------------------------------------------------------------------------- the child: seed, then time the page


def _child(backend: str, volunteers: int, teams: int, requests: int) -> int:
    import django

    django.setup()
    from django.core.management import call_command

    started = time.monotonic()
    call_command("migrate", verbosity=0, interactive=False)
    migrated = time.monotonic()
    viewer, viewer_name, deltas = _seed(volunteers, teams)
    seeded = time.monotonic()
    gc.collect()  # the seed's hundreds of thousands of objects, or a collection of them lands in a timed request
    print(
        f"{SEEDED}{backend}: {volunteers:,} volunteers (5% anonymous, 20% in no team) in {teams:,} teams; "
        f"a year of credit as {deltas:,} boards.add deltas (a year ago, and an hour in the last 7 days: a seventh "
        f"of them in the last 24 hours), no ledger rows; viewer {viewer_name!r} at rank {viewer[1]:,} of all time; "
        f"migrate {migrated - started:.1f} s, "
        f"seed {seeded - migrated:.1f} s",
        flush=True,
    )
    sys.stdin.readline()  # the parent's go: the other backend has seeded too, and is not timing now
    for period in PERIODS:
        timings = _time_page(viewer, viewer_name, period, requests)
        print(
            f"bench: leaderboard_ms_{backend}_{period}=p50 {percentile(timings, 50):.1f} "
            f"p99 {percentile(timings, 99):.1f}",
            flush=True,
        )
    return 0


def _seed(volunteers: int, teams: int) -> tuple[tuple[int, int], str, int]:
    """Users, profiles and teams in the database, a year of credit on the boards.

    Returns the viewer (user id, all-time rank), their public name and the number of deltas added.
    """
    import numpy as np
    from django.contrib.auth import get_user_model

    from crowdtrain.accounts.models import Profile, Team
    from crowdtrain.credit import boards
    from crowdtrain.scheduler.hotstate import hot_state

    # People: bulk_create skips save() and signals, so slugs, invite codes (a field default) and profiles are ours.
    team_ids = [
        t.pk
        for t in Team.objects.bulk_create(
            [Team(name=f"Bench team {j}", slug=f"bench-team-{j}") for j in range(teams)], batch_size=2000
        )
    ]
    users = get_user_model().objects.bulk_create(
        [
            get_user_model()(username=f"bench-{i:06d}", email=f"bench-{i:06d}@example.org", password="!")
            for i in range(volunteers)
        ],
        batch_size=2000,
    )
    team_of = [None if i % 5 == 0 else team_ids[i % teams] for i in range(volunteers)]
    Profile.objects.bulk_create(
        [
            Profile(
                user_id=u.pk,
                display_name=f"Bench volunteer {i}" if i % 3 else "",
                anonymous=i % 20 == 1,
                team_id=team_of[i],
            )
            for i, u in enumerate(users)
        ],
        batch_size=2000,
    )

    # A year of credit, as the ledger would feed it: heavy-tailed, like real volunteers' hardware and hours.
    # Two deltas each (a few hours stand for the year's 8,760): the fakeredis of the embedded default runs
    # some 30 us a command, and each delta is 10-20 commands.
    rng = np.random.default_rng(0)
    year = rng.lognormal(mean=12.0, sigma=2.0, size=volunteers)  # credits (GFLOP)
    week = year / 52 * rng.uniform(0.2, 1.8, size=volunteers)
    now = time.time()
    current = int(now // HOUR)
    recent_hour = [current - (i * 7919) % WEEK_HOURS for i in range(volunteers)]  # a seventh in the last 24 h
    deltas = []
    for i, u in enumerate(users):
        deltas += [
            boards.Delta(u.pk, team_of[i], CAMPAIGN_ID, float(year[i] - week[i]), current - 24 * 365 + i % 24),
            boards.Delta(u.pk, team_of[i], CAMPAIGN_ID, float(week[i]), recent_hour[i]),
        ]
    for start in range(0, len(deltas), 5000):
        boards.add(deltas[start : start + 5000], now=now)
    # The ledger holds none of this year (the page never reads it). As on a site that has been up, the boards
    # count as built, or the first reader would rebuild them from the empty ledger, and as aged to this hour.
    client = hot_state().client
    client.set(boards._built_key(), int(now))
    client.set(boards._aged_key(), current)

    # The viewer: a named volunteer about 90% of the way down the all-time board, on the 24-hour board too.
    depth = int(volunteers * VIEWER_DEPTH)
    around, _ = boards.page(boards.EVERY_CAMPAIGN, "volunteers", "all", depth, 1000)
    profiles = {p.user_id: p for p in Profile.objects.filter(user_id__in=[r.subject_id for r in around])}
    index = {u.pk: i for i, u in enumerate(users)}
    for row in around:
        profile = profiles[row.subject_id]
        if not profile.anonymous and profile.display_name and recent_hour[index[row.subject_id]] > current - 24:
            return (row.subject_id, row.rank), profile.public_name, len(deltas)
    raise RuntimeError(f"no named volunteer active today at ranks {depth + 1}-{depth + 1000}; seed more volunteers")


def _time_page(viewer: tuple[int, int], viewer_name: str, period: str, requests: int) -> list[float]:
    """Milliseconds of each of ``requests`` GETs of the page for one period, after unmeasured warm-up ones.

    The first answer must show the viewer's standing (their all-time rank on the all-time board): a page
    that skipped the lookup, or failed, would time something else.
    """
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client(HTTP_HOST="127.0.0.1")  # an allowed host, without Django's test environment
    client.force_login(get_user_model().objects.get(pk=viewer[0]))
    url = f"/leaderboards/?period={period}"
    response = client.get(url)
    standing = 'data-testid="my-rank">' + (f"{viewer[1]}<" if period == "all" else "")
    if response.status_code != 200 or standing not in response.content.decode():
        raise RuntimeError(f"{url} answered {response.status_code} without the viewer's standing ({viewer_name})")
    for _ in range(WARMUP_REQUESTS):
        client.get(url)
    timings = []
    for _ in range(requests):
        began = time.perf_counter()
        client.get(url)
        timings.append((time.perf_counter() - began) * 1000.0)
    return timings


if __name__ == "__main__":
    sys.exit(main())

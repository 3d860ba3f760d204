"""Browser tests: Debian's Chromium through Playwright against the real site on daphne, sharing the test database.

Run them in a pytest process of their own (``make test-browser``, or make test's third pass)::

    .venv/bin/python -m tests.services .venv/bin/python -m pytest tests/browser \\
        --output test-artifacts/browser --screenshot only-on-failure

How the pieces fit: pytest-django creates and migrates a test database of
this pass's own; the site is one daphne child for the whole session (started
by the launcher the end-to-end tests use), pointed at that same database, so
a test seeds rows with the ORM and the browser sees them. Every browser test
is a transactional test (autouse ``live_site``): its rows are committed, and
the tables are emptied after it. Serialized rollback then puts back what the
migrations created, with the same ids, so the content types the site has
cached stay right. The site's e-mail goes to files that ``outbox`` reads; its
channel layer and cache use a Redis database of their own, emptied per test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from playwright.sync_api import Page, Playwright, expect
from slugify import slugify

from crowdtrain_launcher import REPO_ROOT, Swarm
from tests.browser.live_site import LiveSite, Outbox, Shot, site_database_url

# Sync Playwright keeps an event loop running in this thread, and Django refuses ORM calls
# next to a running loop. Only this process is exempt: the site child gets the variable
# emptied (below), so it still catches sync database calls made from async code.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = Path("/usr/bin/chromium")
# Measured on our machines (../shared/STACK.md); Playwright adds --headless itself unless --headed.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]  # fmt: skip
BROWSER_TESTS = Path(__file__).resolve().parent
# test-artifacts/ is gitignored; the Makefile's --output sends pytest-playwright's failure screenshots here too.
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
SITE_LOG_LINES = 60
# The site's own Redis database (channel layer, cache with allauth's rate-limit counters), emptied
# before each test; tests of the second pass, maybe running beside us, keep the one REDIS_URL names.
SITE_REDIS_DB = 14
CONTACT_EMAIL = "help@crowdtrain.test"

# Two shared cores and a cold site: give assertions more than Playwright's default 5 s.
expect.set_options(timeout=10_000)

_site_log_start = pytest.StashKey[tuple[Path, int]]()


# ----------------------------------------------------------------- the site


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings: None) -> None:
    """A test database of its own (``test_test_browser``): a second pass run beside this one won't drop it."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    test = database.setdefault("TEST", {})
    name = test.get("NAME") or f"test_{database['NAME']}"
    test["NAME"] = f"{name}_browser"


@pytest.fixture(scope="session")
def django_db_setup(playwright: Playwright, django_db_setup: None) -> None:
    """pytest-django's, but only once Playwright runs.

    Django keeps a second set of database connections for threads with a
    running event loop, and sync Playwright's loop runs from its start to its
    stop. A test database set up before Playwright would leave its connection,
    and the serialized rows that serialized rollback restores, in the first
    set, out of the tests' sight: every flush would then recreate the content
    types under new ids, and the site's cached ids would break its admin log.
    """


@pytest.fixture(scope="session")
def live_site_process(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSite]:
    """Start daphne once per session on the test database; it stops before pytest-django drops that."""
    folder = tmp_path_factory.mktemp("live-site")
    outbox = folder / "outbox"
    outbox.mkdir()
    env = {
        "DATABASE_URL": site_database_url(),
        "CROWDTRAIN_VAR_DIR": str(folder / "var"),
        "CROWDTRAIN_MEDIA_ROOT": str(folder / "media"),
        "CROWDTRAIN_EMAIL_URL": f"file:///{outbox}",  # dj-email-url drops the path's first slash
        "CROWDTRAIN_CONTACT_EMAIL": CONTACT_EMAIL,  # where the pages promise contact, they show it
        # No Celery worker runs in tests: tasks a page starts run inside its request.
        "CELERY_TASK_ALWAYS_EAGER": "true",
        "DJANGO_ALLOW_ASYNC_UNSAFE": "",  # Django reads empty as unset
    }
    redis_url = None
    if os.environ.get("REDIS_URL"):  # make test's third pass: channel layer and cache on Redis
        redis_url = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{SITE_REDIS_DB}"))
        env["REDIS_URL"] = redis_url
    swarm = Swarm(folder, env=env)
    try:
        swarm.manage("build_agent_wheel")  # as manage.py serve does at start: the join pages link it
        site = swarm.start_site()
        yield LiveSite(url=site.url, outbox=Outbox(outbox), swarm=swarm, redis_url=redis_url)
    finally:
        swarm.stop(grace_s=5.0)


@pytest.fixture(autouse=True)
def live_site(
    request: pytest.FixtureRequest,
    live_site_process: LiveSite,
    transactional_db: None,
    django_db_serialized_rollback: None,
) -> LiveSite:
    """The session's site, with only the migrations' rows in its database, an empty outbox and no rate limits.

    Autouse: every browser test may use the ORM on the site's database, and
    whatever it or the browser wrote is gone before the next test.
    """
    live_site_process.check()
    live_site_process.outbox.clear()
    # Rate-limit counters would otherwise carry over from earlier tests and runs. Without Redis the
    # site keeps them in its own memory, and one session is too short to reach a limit.
    if live_site_process.redis_url:
        with redis.Redis.from_url(live_site_process.redis_url) as client:
            client.flushdb()
    log = live_site_process.log_path
    request.node.stash[_site_log_start] = (log, log.stat().st_size)
    return live_site_process


@pytest.fixture(scope="session")
def base_url(live_site_process: LiveSite) -> str:
    """pytest-playwright gives every browser context this base URL: tests write ``page.goto("/admin/")``."""
    return live_site_process.url


@pytest.fixture
def outbox(live_site: LiveSite) -> Outbox:
    """The site's outbox, empty when the test starts: ``outbox.newest(to="ada@example.org").links[0]``."""
    return live_site.outbox


# ----------------------------------------------------------------- the browser


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any], browser_name: str) -> dict[str, Any]:
    """Debian's Chromium by path: ``playwright install`` downloads browsers from hosts we cannot reach."""
    if browser_name != "chromium":
        raise pytest.UsageError(f"browser tests run on Debian's Chromium only, not {browser_name}")
    if not CHROMIUM.exists():
        raise pytest.UsageError(f"{CHROMIUM} is missing: run `make chromium` (apt-get install chromium)")
    return {**browser_type_launch_args, "executable_path": str(CHROMIUM), "args": CHROMIUM_FLAGS}


@pytest.fixture(scope="session", autouse=True)
def _fresh_artifacts() -> None:
    # The Makefile's --output makes pytest-playwright do this too; without it old screenshots would linger.
    shutil.rmtree(ARTIFACTS, ignore_errors=True)


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Shot:
    """``shot(page, "after login")`` saves test-artifacts/browser/<test>/01-after-login.png and returns its path.

    The folder is the one pytest-playwright names after the same test, so its failure screenshots land beside.
    """
    folder = ARTIFACTS / slugify(request.node.nodeid)
    taken = 0

    def take(page: Page, name: str) -> Path:
        nonlocal taken
        taken += 1
        path = folder / f"{taken:02d}-{slugify(name)}.png"
        page.screenshot(path=path, full_page=True)
        return path

    return take


# ----------------------------------------------------------------- hooks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse runs that mix browser tests with others; mark browser tests ``e2e``."""
    outside = [item.nodeid for item in items if BROWSER_TESTS not in item.path.parents]
    if outside:
        raise pytest.UsageError(
            f"browser tests run in a pytest process of their own (`pytest tests/browser`), but "
            f"{len(outside)} other tests were collected with them, e.g. {outside[0]}: a sync Playwright "
            "page breaks every later async test in the process"
        )
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed browser test shows what the site logged while it ran (a 500's traceback is there)."""
    report = yield
    if report.failed and _site_log_start in item.stash:
        log, start = item.stash[_site_log_start]
        with log.open("rb") as handle:
            handle.seek(start)
            lines = handle.read().decode(errors="replace").splitlines()[-SITE_LOG_LINES:]
        report.sections.append((f"site log {log} during this test (last {SITE_LOG_LINES} lines)", "\n".join(lines)))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    if ARTIFACTS.is_dir() and any(ARTIFACTS.rglob("*.png")):
        terminalreporter.write_sep("-", "browser screenshots")
        terminalreporter.write_line(f"{ARTIFACTS}/<test>/*.png")

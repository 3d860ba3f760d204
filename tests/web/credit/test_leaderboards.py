"""Leaderboards: sorted sets fed by the ledger, windows that move hour by hour, rebuilt from the ledger when lost,
and pages that show public names, the viewer's own row and clear errors for a bad address."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit import boards
from crowdtrain.credit.models import FLOPS_PER_CREDIT, CreditEntry
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from tests.conftest import redis_lost_its_keys
from tests.factories import commit_leases, logged_in, make_campaign, make_device, make_user

pytestmark = pytest.mark.django_db

NOW = 1_800_000_000.0  # a fixed "now" for the window tests
HOUR = 3600


def _delta(volunteer: int, credit: float, *, team: int | None = None, campaign: int = 7, hours_ago: int = 0) -> Any:
    return boards.Delta(volunteer, team, campaign, credit, int(NOW // HOUR) - hours_ago)


def _ids(rows: list[boards.Row]) -> list[int]:
    return [r.subject_id for r in rows]


def _fresh_boards() -> None:
    """Mark the boards built and aged at NOW, as a site that has been up does."""
    client = hot_state().client
    client.set(boards._built_key(), 1)
    client.set(boards._aged_key(), int(NOW // HOUR))


def test_boards_rank_by_credit_per_scope_and_subject(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)
    _fresh_boards()
    boards.add([_delta(1, 5.0, team=10), _delta(2, 9.0, team=10), _delta(3, 1.0, team=11, campaign=8)], now=NOW)

    rows, total = boards.page(boards.EVERY_CAMPAIGN, "volunteers", "all", 0, 10)
    assert _ids(rows) == [2, 1, 3] and [r.rank for r in rows] == [1, 2, 3] and total == 3
    assert _ids(boards.page(7, "volunteers", "all", 0, 10)[0]) == [2, 1]  # campaign 8's volunteer is not here
    teams, _ = boards.page(boards.EVERY_CAMPAIGN, "teams", "7d", 0, 10)
    assert [(r.subject_id, r.credit) for r in teams] == [(10, 14.0), (11, 1.0)]
    assert boards.standing(boards.EVERY_CAMPAIGN, "volunteers", "24h", 3) == boards.Row(3, 3, 1.0)
    assert boards.standing(boards.EVERY_CAMPAIGN, "volunteers", "24h", 99) is None
    assert _ids(boards.page(boards.EVERY_CAMPAIGN, "volunteers", "all", 1, 1)[0]) == [1]  # an offset page


def test_windows_move_hour_by_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [NOW]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    _fresh_boards()
    boards.add([_delta(1, 1.0, hours_ago=0), _delta(2, 2.0, hours_ago=23), _delta(3, 3.0, hours_ago=30)], now=NOW)

    def board(period: str) -> list[int]:
        return _ids(boards.page(boards.EVERY_CAMPAIGN, "volunteers", period, 0, 10)[0])  # type: ignore[arg-type]

    assert (board("24h"), board("7d"), board("all")) == ([2, 1], [3, 2, 1], [3, 2, 1])
    clock[0] = NOW + HOUR  # volunteer 2's hour leaves the 24-hour window
    assert (board("24h"), board("7d")) == ([1], [3, 2, 1])
    clock[0] = NOW + 24 * 7 * HOUR  # a week on: only all time remembers
    assert (board("24h"), board("7d"), board("all")) == ([], [], [3, 2, 1])


def test_a_reversal_takes_the_credit_back_in_the_hour_of_its_grant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)
    _fresh_boards()
    boards.add([_delta(1, 4.0, hours_ago=30), _delta(2, 1.0)], now=NOW)
    boards.add([_delta(1, -4.0, hours_ago=30)], now=NOW)

    for period in ("24h", "7d", "all"):
        assert _ids(boards.page(boards.EVERY_CAMPAIGN, "volunteers", period, 0, 10)[0]) == [2]  # type: ignore[arg-type]


def test_committed_work_moves_the_boards_and_a_rebuild_from_the_ledger_gives_the_same(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    team = Team.objects.create(name="Owls")
    Profile.objects.filter(user=alice.owner).update(team=team)
    with django_capture_on_commit_callbacks(execute=True):
        commit_leases(campaign, [alice.pk, bob.pk, alice.pk], leases=6)

    def snapshot() -> dict[str, list[tuple[int, float]]]:
        return {
            f"{scope}:{subject}:{period}": [
                (r.subject_id, float(f"{r.credit:.9g}")) for r in boards.page(scope, subject, period, 0, 10)[0]
            ]
            for scope in (boards.EVERY_CAMPAIGN, campaign.pk)
            for subject in boards.SUBJECTS
            for period in boards.PERIODS
        }

    live = snapshot()
    ledger: dict[int, float] = {}
    for entry in CreditEntry.objects.all():
        ledger[entry.volunteer_id] = ledger.get(entry.volunteer_id, 0.0) + entry.flops / FLOPS_PER_CREDIT
    assert dict(live["0:volunteers:all"]) == pytest.approx(ledger) and len(ledger) == 2
    assert [t for t, _ in live["0:teams:24h"]] == [team.pk]

    hot_state().client.delete(boards._built_key(), boards._board(0, "volunteers", "all"))  # Redis lost them
    assert snapshot() == live


def test_the_page_shows_public_names_and_the_viewers_row_even_far_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)
    _fresh_boards()
    users = [make_user(f"v{i}") for i in range(60)]
    Profile.objects.filter(user=users[0]).update(display_name="Ada", anonymous=False)
    Profile.objects.filter(user=users[1]).update(display_name="Secret", anonymous=True)
    boards.add([_delta(u.pk, 100.0 - i) for i, u in enumerate(users)], now=NOW)
    viewer = users[55]
    client = logged_in(viewer)

    first = client.get("/leaderboards/?period=24h")
    jumped = client.get("/leaderboards/?period=24h&me=1")

    assert first.status_code == 200
    page = first.content.decode()
    assert "Ada" in page and ANONYMOUS_NAME in page and "Secret" not in page and "@" not in page
    assert first.context["board"]["me"]["rank"] == 56 and not first.context["board"]["me_on_page"]
    assert jumped.context["board"]["page"] == 2 and jumped.context["board"]["me_on_page"]
    assert 'class="board-mine"' in jumped.content.decode()
    feed = client.get("/api/leaderboards?period=24h&page=2").json()
    assert feed["me"]["rank"] == 56 and [r["rank"] for r in feed["rows"]][:2] == [51, 52]


@pytest.mark.parametrize(
    ("query", "named"),
    [("of=robots", "of:"), ("period=1y", "period:"), ("campaign=abc", "campaign:"), ("page=0", "page:"),
     ("campaign=999999", "no campaign 999999")],
)  # fmt: skip
def test_a_bad_address_is_a_400_that_names_the_field(query: str, named: str) -> None:
    page = Client().get(f"/leaderboards/?{query}")
    feed = Client().get(f"/api/leaderboards?{query}")

    assert page.status_code == 400 and named in page.content.decode()
    assert feed.status_code == 400 and named in feed.json()["error"]


def test_an_invite_only_campaigns_board_is_not_shown_to_outsiders() -> None:
    campaign = make_campaign(visibility=Campaign.Visibility.INVITE)

    answer = Client().get(f"/leaderboards/?campaign={campaign.pk}")

    assert answer.status_code == 400 and f"no campaign {campaign.pk}" in answer.content.decode()


def test_the_navigation_links_the_leaderboards() -> None:
    assert 'href="/leaderboards/"' in Client().get("/leaderboards/").content.decode()


def test_credit_entries_outlive_nothing_they_should_not(django_capture_on_commit_callbacks: Callable[..., Any]) -> None:
    """A lease record still says what it credited: the ledger points at it."""
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    device, _ = make_device()
    with django_capture_on_commit_callbacks(execute=True):
        commit_leases(campaign, [device.pk], leases=2)
    lease = Lease.objects.filter(step__isnull=False).first()
    assert lease is not None and lease.credit_entries.get().created_at <= timezone.now()


def test_a_reversal_added_before_the_windows_were_aged_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [NOW]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    _fresh_boards()
    boards.add([_delta(1, 5.0, hours_ago=23), _delta(2, 1.0)], now=NOW)

    clock[0] = NOW + HOUR  # an hour on, before any reader ages the windows, the old grant is taken back
    boards.add([_delta(1, -5.0, hours_ago=23)], now=clock[0])

    for period in ("24h", "7d", "all"):
        assert _ids(boards.page(boards.EVERY_CAMPAIGN, "volunteers", period, 0, 10)[0]) == [2]  # type: ignore[arg-type]


def _every_board() -> dict[str, dict[str, float]]:
    client = hot_state().client
    keys = [k for k in client.scan_iter(match=f"{boards._prefix()}*") if client.type(k) == "zset"]
    return {k: dict(client.zrange(k, 0, -1, withscores=True)) for k in keys}


@settings(max_examples=40)
@given(
    deltas=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.one_of(st.none(), st.integers(10, 11)),
            st.integers(7, 8),
            st.integers(-20, 20).map(lambda quarters: quarters / 4),
            st.sampled_from([0, 5, 30, 200]),
        ),
        max_size=25,
    )
)
def test_a_batch_counts_on_every_board_as_its_deltas_one_at_a_time(
    deltas: list[tuple[int, int | None, int, float, int]],
) -> None:
    # A commit's deltas are summed per board and member before they reach Redis: the same boards as one by one.
    batch = [_delta(volunteer, credit, team=team, campaign=campaign, hours_ago=ago)
             for volunteer, team, campaign, credit, ago in deltas]  # fmt: skip
    redis_lost_its_keys()
    _fresh_boards()
    boards.add(batch, now=NOW)
    together = _every_board()
    redis_lost_its_keys()
    _fresh_boards()
    for delta in batch:
        boards.add([delta], now=NOW)

    assert _every_board() == together

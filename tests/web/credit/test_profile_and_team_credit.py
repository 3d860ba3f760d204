"""A volunteer's profile and a team's page show their credit: totals, rank, a 7-day average and 30 days of bars,
all equal to the ledger, and each member's share of the team's credit under their public name only."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Sum
from django.test import Client
from django.utils import timezone
from django.utils.html import escape

from crowdtrain.accounts.models import ANONYMOUS_NAME, Device, Profile, Team
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit import export, summaries
from crowdtrain.credit.models import FLOPS_PER_CREDIT, FORMULA, CreditEntry
from crowdtrain.scheduler import backbone
from crowdtrain.scheduler.models import Lease
from tests.factories import commit_leases, make_campaign, make_device, make_volunteer

pytestmark = pytest.mark.django_db

Capture = Callable[..., Any]


def _ledger(**filters: Any) -> tuple[float, int]:
    totals = CreditEntry.objects.filter(**filters).aggregate(flops=Sum("flops"), samples=Sum("samples"))
    return (totals["flops"] or 0.0) / FLOPS_PER_CREDIT, int(totals["samples"] or 0)


def _entry(
    device: Device, campaign: Campaign, credit: float, when: datetime, *, reversed_at: datetime | None = None
) -> None:
    """A grant written straight into the ledger at ``when`` (and its reversal at ``reversed_at``)."""
    lease = Lease.objects.create(
        campaign=campaign, device=device, base_version=0, ranges=[], num_samples=1, deadline=when
    )
    fields = {"lease": lease, "volunteer_id": device.owner_id, "device": device, "campaign": campaign}
    CreditEntry.objects.create(
        kind=CreditEntry.Kind.GRANT, samples=1, flops=credit * FLOPS_PER_CREDIT, created_at=when, **fields
    )
    if reversed_at is not None:
        CreditEntry.objects.create(
            kind=CreditEntry.Kind.REVERSAL, samples=-1, flops=-credit * FLOPS_PER_CREDIT, created_at=reversed_at,
            **fields,
        )  # fmt: skip


def test_the_profile_shows_the_ledgers_figures_after_committed_work_and_after_a_rollback(
    client: Client, django_capture_on_commit_callbacks: Capture
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    alice, bob = make_volunteer("alice"), make_volunteer("bob")
    alices_device, bobs_device = make_device("alice")[0], make_device("bob")[0]
    with django_capture_on_commit_callbacks(execute=True):
        commit_leases(campaign, [alices_device.pk, bobs_device.pk, alices_device.pk], leases=6)
    client.force_login(alice)

    page = client.get("/me/")
    committed = page.context["credit"]
    credit, samples = _ledger(volunteer=alice)
    bobs_rank = summaries.of_volunteer(bob.pk).rank
    with django_capture_on_commit_callbacks(execute=True):
        backbone.restore_campaign(campaign.pk, 0)  # every step undone
    rolled_back = client.get("/me/").context["credit"]

    assert credit > 0 and samples == 4 * 8  # 4 of the 6 leases, a step of 8 samples each
    assert (committed.credit, committed.samples) == (pytest.approx(credit), samples)
    assert (committed.rank, bobs_rank) == (1, 2)
    assert committed.recent_average == pytest.approx(credit / 7)
    assert committed.days[-1].credit == pytest.approx(credit)
    html = page.content.decode()
    assert "Your credit" in html and escape(FORMULA) in html and escape(summaries.RECENT_DEFINITION) in html
    assert 'href="/leaderboards/?of=volunteers&amp;period=all&amp;me=1"' in html
    assert _ledger(volunteer=alice) == (pytest.approx(0.0), 0)
    assert (rolled_back.credit, rolled_back.samples, rolled_back.rank) == (pytest.approx(0.0), 0, None)
    assert rolled_back.recent_average == pytest.approx(0.0)
    assert all(d.credit == pytest.approx(0.0) for d in rolled_back.days)


def test_the_recent_average_is_credit_per_day_over_the_last_7_days_only() -> None:
    campaign = make_campaign()
    device, _ = make_device("alice")
    now = timezone.now()
    _entry(device, campaign, 7.0, now - timedelta(hours=2))
    _entry(device, campaign, 14.0, now - timedelta(days=6, hours=23))
    _entry(device, campaign, 700.0, now - timedelta(days=7, hours=1))  # just outside the window
    _entry(device, campaign, 1000.0, now - timedelta(days=20))
    _entry(device, campaign, 70.0, now - timedelta(days=3), reversed_at=now)  # taken back: counts nowhere
    _entry(device, campaign, 5.0, now - timedelta(days=10), reversed_at=now)  # taken back from an old day

    summary = summaries.of_volunteer(device.owner_id, now=now)

    assert summary.recent_average == pytest.approx((7.0 + 14.0) / 7)
    assert summary.credit == pytest.approx(_ledger(volunteer=device.owner_id)[0]) == pytest.approx(1721.0)
    assert sum(d.credit for d in summary.days) == pytest.approx(1721.0)  # the reversed days show nothing


def test_the_chart_has_a_bar_for_each_of_the_last_30_days(client: Client) -> None:
    campaign = make_campaign()
    alice = make_volunteer("alice")
    device, _ = make_device("alice")
    now = timezone.now()
    _entry(device, campaign, 2.0, now)
    _entry(device, campaign, 8.0, now - timedelta(days=3))
    _entry(device, campaign, 4.0, now - timedelta(days=29))
    _entry(device, campaign, 99.0, now - timedelta(days=30))  # before the chart
    client.force_login(alice)

    page = client.get("/me/")

    days = page.context["credit"].days
    today = timezone.localdate(now)
    assert [d.day for d in days] == [today - timedelta(days=back) for back in range(29, -1, -1)]
    assert [(i, d.credit) for i, d in enumerate(days) if d.credit] == [(0, 4.0), (26, 8.0), (29, 2.0)]
    svg = re.search(r"<svg[^>]*>.*?</svg>", page.content.decode(), re.S)
    assert svg is not None
    assert 'role="img"' in svg.group() and 'aria-label="Daily credit for the last 30 days' in svg.group()
    bars = re.findall(r'<rect [^>]*height="([0-9.]+)"><title>([^<]*)</title></rect>', svg.group())
    assert len(bars) == 30
    assert bars[29][1] == f"{today:%b} {today.day}, {today.year}: 2.000 credit"
    assert [float(h) for h, _ in bars].count(0.0) == 27 and float(bars[26][0]) == 100.0  # the best day is full height
    # Its y-axis: the best day's credit at the top, so a bar's height reads as a number (issue 34).
    assert re.search(r'data-testid="credit-chart-top">8 credit<', page.content.decode())


def test_before_any_credit_the_chart_says_so_instead_of_an_empty_box(client: Client) -> None:
    alice = make_volunteer("alice")
    client.force_login(alice)

    html = client.get("/me/").content.decode()

    assert 'data-testid="credit-chart-empty"' in html and "<svg" not in html.split("credit-chart-empty")[1][:400]
    assert 'data-testid="credit-chart"' not in html


def _team_with_work(capture: Capture) -> tuple[Team, dict[str, AbstractBaseUser]]:
    """Ada and a volunteer who hides their name do the work; a third member has none yet."""
    campaign = make_campaign(target_batch_size=8, microbatch_size=4)
    team = Team.objects.create(name="Night Owls")
    people = {name: make_volunteer(name) for name in ("ada", "hidden", "idle")}
    Profile.objects.filter(user__in=people.values()).update(team=team)
    Profile.objects.filter(user=people["ada"]).update(display_name="Ada L.")
    Profile.objects.filter(user=people["hidden"]).update(display_name="Secret Sam", anonymous=True)
    devices = [make_device("ada")[0].pk, make_device("hidden")[0].pk, make_device("ada")[0].pk]
    with capture(execute=True):
        commit_leases(campaign, devices, leases=6)
    return team, people


def test_the_team_page_shows_the_teams_figures_and_shares_that_add_up_to_them(
    client: Client, django_capture_on_commit_callbacks: Capture
) -> None:
    team, people = _team_with_work(django_capture_on_commit_callbacks)
    client.force_login(people["idle"])

    page = client.get(team.get_absolute_url())

    credit, samples = _ledger(team=team)
    shown = page.context["credit"]
    assert credit > 0 and (shown.credit, shown.samples, shown.rank) == (pytest.approx(credit), samples, 1)
    shares = {member.user_id: share for member, share in page.context["member_shares"]}
    assert shares[people["idle"].pk] is None
    assert shares[people["ada"].pk].credit == pytest.approx(_ledger(volunteer=people["ada"])[0])
    assert sum(s.credit for s in shares.values() if s) == pytest.approx(credit)
    assert sum(s.percent for s in shares.values() if s) == pytest.approx(100.0)
    html = page.content.decode()
    assert "Team credit" in html and "66.7%" in html and "33.3%" in html
    assert 'href="/leaderboards/?of=teams&amp;period=all&amp;me=1"' in html


def test_no_email_address_appears_on_the_team_page(client: Client, django_capture_on_commit_callbacks: Capture) -> None:
    team, people = _team_with_work(django_capture_on_commit_callbacks)
    Profile.objects.filter(user=people["ada"]).update(display_name="")  # the fallback name must hide the address
    client.force_login(people["ada"])

    html = client.get(team.get_absolute_url()).content.decode()

    assert f"Volunteer {people['ada'].pk}" in html
    assert "@" not in html and "example.org" not in html


def test_an_anonymous_member_and_their_share_are_shown_anonymously(
    client: Client, django_capture_on_commit_callbacks: Capture
) -> None:
    team, people = _team_with_work(django_capture_on_commit_callbacks)

    page = Client().get(team.get_absolute_url())  # a stranger
    shares = summaries.shares_of_team(team.pk)

    html = page.content.decode()
    assert "Secret Sam" not in html and "hidden" not in html
    hidden = next(s for s in shares if s.volunteer_id == people["hidden"].pk)
    assert hidden.name == ANONYMOUS_NAME and hidden.credit > 0
    rows = re.findall(r'<li data-testid="member">\s*([^<]+?)\s*(?:<span class="badge">[^<]*</span>\s*)*'
                      r'<span class="member-credit"[^>]*>([^<]*)</span>', html)  # fmt: skip
    assert (ANONYMOUS_NAME, "33.3%") in [(name, share.split(" · ")[-1]) for name, share in rows]


def test_a_former_members_credit_stays_with_the_team_and_the_shares_still_add_up(
    client: Client, django_capture_on_commit_callbacks: Capture
) -> None:
    team, people = _team_with_work(django_capture_on_commit_callbacks)
    Profile.objects.filter(user=people["ada"]).update(team=None)  # Ada leaves after doing her work

    page = client.get(team.get_absolute_url())

    credit, _ = _ledger(team=team)
    current = sum(s.credit for _, s in page.context["member_shares"] if s)
    former = page.context["former_credit"]
    assert page.context["former_count"] == 1 and former == pytest.approx(_ledger(volunteer=people["ada"])[0])
    assert current + former == pytest.approx(credit) == pytest.approx(page.context["credit"].credit)
    assert "Ada L." not in page.content.decode()  # those who left are not listed by name


def test_a_summary_costs_the_same_few_queries_however_large_the_ledger(
    django_assert_num_queries: Callable[..., Any],
) -> None:
    campaign = make_campaign()
    device, _ = make_device("alice")
    others = [make_device(f"other{i}")[0] for i in range(3)]
    now = timezone.now()
    _entry(device, campaign, 1.0, now)
    summaries.of_volunteer(device.owner_id)  # builds the leaderboards once, as the first reader after a restart does

    with django_assert_num_queries(2):
        small = summaries.of_volunteer(device.owner_id)
    for i in range(60):
        _entry(others[i % 3], campaign, 1.0, now - timedelta(hours=i))
        _entry(device, campaign, 1.0, now - timedelta(hours=i))
    with django_assert_num_queries(2):
        large = summaries.of_volunteer(device.owner_id)

    assert (small.credit, large.credit) == (pytest.approx(1.0), pytest.approx(61.0))


def test_the_stats_export_and_the_profile_agree_on_the_recent_average() -> None:
    """One definition: old work taken back today changes neither (it counts in its grant's hour, outside)."""
    device, _ = make_device("ada")
    campaign = make_campaign()
    now = timezone.now()
    _entry(device, campaign, 7.0, now - timedelta(hours=2))
    _entry(device, campaign, 50.0, now - timedelta(days=10), reversed_at=now - timedelta(minutes=5))
    _entry(device, campaign, 3.0, now - timedelta(days=3), reversed_at=now - timedelta(minutes=1))

    (row,) = json.loads(_export_text())["users"]

    assert summaries.of_volunteer(device.owner_id).recent_average == pytest.approx(1.0)
    assert row["recent_credit_per_day"] == pytest.approx(1.0)


def _export_text() -> str:
    buffer = io.BytesIO()
    export.write_document(buffer)
    return buffer.getvalue().decode()

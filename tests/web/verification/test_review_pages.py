"""The standing page and the review queue: a quarantined volunteer reads why and appeals, an admin clears or bans
them from the queue, and nobody else can."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device, Profile
from crowdtrain.verification import quarantine
from crowdtrain.verification.models import Answer, Check, Standing
from tests.factories import logged_in, make_admin, make_campaign, make_device, make_volunteer

pytestmark = pytest.mark.django_db

REASON = "3 of 4 of its results disagreed with those of other volunteers who computed the same samples"


@pytest.fixture
def vera() -> AbstractBaseUser:
    """The volunteer in quarantine."""
    user = make_volunteer("vera")
    Profile.objects.filter(user=user).update(display_name="Vera V.")
    quarantine.quarantine(user.pk, REASON)
    return user


@pytest.fixture
def ada() -> AbstractBaseUser:
    return make_admin("ada")


@pytest.fixture
def stan() -> AbstractBaseUser:
    """A volunteer in good standing, not staff."""
    return make_volunteer("stan")


def _state(user: AbstractBaseUser) -> str:
    return Standing.objects.get(volunteer=user).state


def _failed_answer(user: AbstractBaseUser) -> Answer:
    case = Check.objects.create(
        campaign=make_campaign(), lease_id=4242, volunteer=user, base_version=3, ranges=[[0, 0, 0, 4]], num_samples=4,
        state=Check.State.FAILED,
    )  # fmt: skip
    return Answer.objects.create(
        case=case, lease_id=4242, role=Answer.Role.ORIGINAL, volunteer=user, verdict=Answer.Verdict.DISAGREED,
        cosine=-0.125, norm_ratio=3.5, reported_at=timezone.now(),
    )  # fmt: skip


def test_a_volunteer_who_is_not_staff_can_neither_see_nor_use_the_queue(
    vera: AbstractBaseUser, stan: AbstractBaseUser
) -> None:
    client = logged_in(stan)

    seen = client.get("/staff/review/")
    cleared = client.post(f"/staff/review/{vera.pk}/clear")
    banned = client.post(f"/staff/review/{vera.pk}/ban", {"reason": "no"})
    anonymous = Client().get("/staff/review/")

    assert (seen.status_code, cleared.status_code, banned.status_code) == (403, 403, 403)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")
    assert _state(vera) == Standing.State.QUARANTINED
    assert "Review queue" not in client.get("/me/").content.decode()


def test_an_admin_sees_the_volunteer_their_appeal_and_their_failed_answers(
    vera: AbstractBaseUser, ada: AbstractBaseUser
) -> None:
    _failed_answer(vera)
    logged_in(vera).post("/account/standing/", {"appeal": "My GPU overheated; I replaced its fan."})

    page = logged_in(ada).get("/staff/review/")

    html = page.content.decode()
    assert page.status_code == 200
    assert "Vera V." in html and "vera@example.org" in html and REASON in html
    assert "My GPU overheated; I replaced its fan." in html
    assert "test campaign" in html and "4242" in html and "-0.125" in html and "3.500" in html
    assert 'href="/staff/review/"' in html  # the staff nav link
    assert "No volunteer is in quarantine." not in html


def test_clearing_from_the_queue_puts_the_volunteer_back_in_good_standing(
    vera: AbstractBaseUser, ada: AbstractBaseUser
) -> None:
    response = logged_in(ada).post(f"/staff/review/{vera.pk}/clear", follow=True)

    row = Standing.objects.get(volunteer=vera)
    assert (row.state, row.reviewed_by) == (Standing.State.GOOD, ada)
    html = response.content.decode()
    assert response.redirect_chain == [("/staff/review/", 302)]
    assert "Cleared Vera V. (vera@example.org)" in html
    assert "No volunteer is in quarantine." in html


def test_banning_from_the_queue_revokes_the_volunteers_devices(vera: AbstractBaseUser, ada: AbstractBaseUser) -> None:
    device, _ = make_device("vera")

    response = logged_in(ada).post(f"/staff/review/{vera.pk}/ban", {"reason": "sign-flipped gradients"}, follow=True)

    row = Standing.objects.get(volunteer=vera)
    assert (row.state, row.reason, row.reviewed_by) == (Standing.State.BANNED, "sign-flipped gradients", ada)
    assert Device.objects.get(pk=device.pk).revoked_at is not None
    html = response.content.decode()
    assert "Banned Vera V. (vera@example.org)" in html
    assert "Recently banned" in html and "sign-flipped gradients" in html


def test_a_ban_without_a_reason_says_it_was_after_review(vera: AbstractBaseUser, ada: AbstractBaseUser) -> None:
    logged_in(ada).post(f"/staff/review/{vera.pk}/ban", {"reason": "  "})

    assert Standing.objects.get(volunteer=vera).reason == "banned after review"


def test_a_ban_reason_too_long_bans_nobody_and_names_the_field(vera: AbstractBaseUser, ada: AbstractBaseUser) -> None:
    response = logged_in(ada).post(f"/staff/review/{vera.pk}/ban", {"reason": "x" * 501}, follow=True)

    assert "Ban reason must be at most 500 characters (it has 501)" in response.content.decode()
    assert _state(vera) == Standing.State.QUARANTINED


def test_clearing_someone_not_in_quarantine_changes_nothing_and_says_so(
    stan: AbstractBaseUser, ada: AbstractBaseUser
) -> None:
    cleared = logged_in(ada).post(f"/staff/review/{stan.pk}/clear", follow=True)
    banned = logged_in(ada).post(f"/staff/review/{stan.pk}/ban", follow=True)

    assert "is not in quarantine" in cleared.content.decode() and "is not in quarantine" in banned.content.decode()
    assert not Standing.objects.filter(volunteer=stan).exclude(state=Standing.State.GOOD).exists()


def test_the_standing_page_shows_the_reason_and_saves_an_appeal_that_a_second_replaces(
    vera: AbstractBaseUser,
) -> None:
    client = logged_in(vera)

    page = client.get("/account/standing/")
    client.post("/account/standing/", {"appeal": "First try: my drivers were old."})
    first_at = Standing.objects.get(volunteer=vera).appealed_at
    response = client.post("/account/standing/", {"appeal": "Second try: the fan was broken."}, follow=True)

    html = page.content.decode()
    assert "quarantined" in html and REASON in html and "credit is on hold" in html
    row = Standing.objects.get(volunteer=vera)
    assert row.appeal == "Second try: the fan was broken."
    assert first_at is not None and row.appealed_at is not None and row.appealed_at >= first_at
    assert "Appeal sent." in response.content.decode() and 'data-testid="appeal-sent"' in response.content.decode()


def test_a_too_short_appeal_shows_an_error_that_names_the_field(vera: AbstractBaseUser) -> None:
    response = logged_in(vera).post("/account/standing/", {"appeal": "sorry"})

    assert response.status_code == 200
    assert response.context["form"].errors["appeal"] == ["Your appeal needs at least 10 characters (it has 5)."]
    assert "Your appeal needs at least 10 characters" in response.content.decode()
    assert Standing.objects.get(volunteer=vera).appeal == ""


def test_a_volunteer_in_good_standing_is_told_so_and_cannot_appeal(stan: AbstractBaseUser) -> None:
    client = logged_in(stan)

    page = client.get("/account/standing/")
    refused = client.post("/account/standing/", {"appeal": "Nothing to appeal, really."}, follow=True)

    assert "in good standing" in page.content.decode() and "<textarea" not in page.content.decode()
    assert "Only a quarantined account can appeal" in refused.content.decode()
    assert not Standing.objects.filter(volunteer=stan).exists()


def test_the_profile_links_to_the_standing_page(vera: AbstractBaseUser) -> None:
    html = logged_in(vera).get("/me/").content.decode()

    assert 'href="/account/standing/"' in html and "<strong>quarantined</strong>, so your credit is on hold" in html


def test_an_appeal_to_an_earlier_quarantine_is_not_shown_for_a_new_one(
    vera: AbstractBaseUser, ada: AbstractBaseUser
) -> None:
    logged_in(vera).post("/account/standing/", {"appeal": "An appeal to the first quarantine."})
    quarantine.clear(vera.pk, ada.pk)

    quarantine.quarantine(vera.pk, "again")

    assert "An appeal to the first quarantine." not in logged_in(ada).get("/staff/review/").content.decode()

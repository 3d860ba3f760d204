"""The Django admin lists standings and checks read-only, and its clear and ban actions do what the queue's do."""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.verification import quarantine
from crowdtrain.verification.models import Answer, Check, Standing
from tests.factories import make_admin, make_campaign, make_device, make_volunteer

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/verification/standing/"


@pytest.fixture
def admin_client(client: Client) -> Client:
    admin = make_admin("ada")
    admin.is_superuser = True
    admin.save(update_fields=["is_superuser"])
    client.force_login(admin)
    return client


def _action(client: Client, action: str, *standings: Standing) -> str:
    response = client.post(CHANGELIST, {"action": action, "_selected_action": [s.pk for s in standings]}, follow=True)
    assert response.status_code == 200
    return response.content.decode()


def test_the_clear_action_clears_quarantined_volunteers_and_leaves_others(admin_client: Client) -> None:
    vera, stan = make_volunteer("vera"), make_volunteer("stan")
    quarantine.quarantine(vera.pk, "disagreed")
    stans = Standing.objects.create(volunteer=stan)

    html = _action(admin_client, "clear", Standing.objects.get(volunteer=vera), stans)

    assert Standing.objects.get(volunteer=vera).state == Standing.State.GOOD
    assert "1 of 2 volunteers cleared." in html and "1 were left as they were" in html


def test_the_ban_action_bans_and_revokes_devices(admin_client: Client) -> None:
    vera = make_volunteer("vera")
    device, _ = make_device("vera")
    quarantine.quarantine(vera.pk, "disagreed")

    html = _action(admin_client, "ban", Standing.objects.get(volunteer=vera))

    assert Standing.objects.get(volunteer=vera).state == Standing.State.BANNED
    assert Device.objects.get(pk=device.pk).revoked_at is not None
    assert "1 of 1 volunteers banned." in html


def test_standings_are_searched_by_email_and_checks_show_their_answers(admin_client: Client) -> None:
    vera = make_volunteer("vera")
    quarantine.quarantine(vera.pk, "disagreed")
    case = Check.objects.create(
        campaign=make_campaign(), lease_id=77, volunteer=vera, base_version=0, ranges=[], num_samples=4
    )
    Answer.objects.create(
        case=case, lease_id=77, role=Answer.Role.ORIGINAL, volunteer=vera, cosine=0.25, reported_at=timezone.now()
    )

    found = admin_client.get(CHANGELIST, {"q": "vera@example"})
    missed = admin_client.get(CHANGELIST, {"q": "nobody@example"})
    detail = admin_client.get(f"/admin/verification/check/{case.pk}/change/")
    filtered = admin_client.get("/admin/verification/check/", {"state__exact": "open"})

    assert "vera@example.org" in found.content.decode() and "vera@example.org" not in missed.content.decode()
    assert detail.status_code == 200 and "0.25" in detail.content.decode()
    assert filtered.status_code == 200 and "77" in filtered.content.decode()

"""Becoming an organizer: a volunteer asks, an admin grants or refuses on the staff page or in the Django admin."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db.migrations import RunPython
from django.test import Client

from crowdtrain.campaigns.models import OrganizerRequest
from crowdtrain.campaigns.organizers import ORGANIZERS_GROUP, is_organizer
from tests.factories import logged_in, make_admin, make_organizer, make_volunteer

pytestmark = pytest.mark.django_db


@pytest.fixture
def vera() -> AbstractBaseUser:
    return make_volunteer("vera")


@pytest.fixture
def admin_client(client: Client) -> Client:
    client.force_login(make_admin("ada"))
    return client


def test_a_migration_creates_the_organizers_group() -> None:
    # Run here rather than looked for: a transactional test run earlier in this process flushes the
    # database, migration data included, so "it exists now" would depend on the order tests ran in.
    migration = importlib.import_module("crowdtrain.campaigns.migrations.0003_organizers_group")
    Group.objects.filter(name=ORGANIZERS_GROUP).delete()

    migration.create_group(django_apps, None)

    assert Group.objects.filter(name=ORGANIZERS_GROUP).exists()
    assert any(
        isinstance(op, RunPython) and op.code is migration.create_group for op in migration.Migration.operations
    ), "the migration runs create_group"


def test_a_volunteer_requests_the_role_from_the_new_campaign_page(vera: AbstractBaseUser) -> None:
    client = logged_in(vera)

    refused = client.get("/campaigns/new")
    response = client.post("/organizers/request", {"reason": "A small GPT on my poetry corpus."}, follow=True)

    assert refused.status_code == 403
    request = OrganizerRequest.objects.get()
    assert request.user == vera and request.decision == OrganizerRequest.Decision.PENDING
    assert request.reason == "A small GPT on my poetry corpus."
    assert 'data-testid="request-pending"' in response.content.decode()


def test_a_request_needs_a_reason(vera: AbstractBaseUser) -> None:
    response = logged_in(vera).post("/organizers/request", {"reason": "   "})

    assert response.status_code == 200
    assert "Say what you want to train" in response.context["form"].errors["reason"][0]
    assert OrganizerRequest.objects.count() == 0


def test_asking_twice_keeps_one_pending_request(vera: AbstractBaseUser) -> None:
    client = logged_in(vera)

    client.post("/organizers/request", {"reason": "first"})
    client.post("/organizers/request", {"reason": "second"})

    assert OrganizerRequest.objects.filter(user=vera).count() == 1


def test_an_organizer_is_not_asked_again() -> None:
    response = logged_in(make_organizer("olga")).post("/organizers/request", {"reason": "again"})

    assert response.status_code == 302 and response["Location"] == "/campaigns/"
    assert OrganizerRequest.objects.count() == 0


def test_an_admin_grants_the_role_and_the_volunteer_can_create_campaigns(
    admin_client: Client, vera: AbstractBaseUser
) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "MLP on sensor data"})
    request = OrganizerRequest.objects.get()

    listed = admin_client.get("/organizers/requests")
    admin_client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "grant"})

    request.refresh_from_db()
    assert "MLP on sensor data" in listed.content.decode()
    assert request.decision == OrganizerRequest.Decision.GRANTED and request.decided_by.username == "ada"
    assert is_organizer(vera)
    assert logged_in(vera).get("/campaigns/new").status_code == 200


def test_an_admin_refuses_and_the_volunteer_sees_it(admin_client: Client, vera: AbstractBaseUser) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "crypto mining"})
    request = OrganizerRequest.objects.get()

    admin_client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "refuse"})
    page = logged_in(vera).get("/organizers/request")

    request.refresh_from_db()
    assert request.decision == OrganizerRequest.Decision.REFUSED and not is_organizer(vera)
    assert "was refused" in page.content.decode()


def test_a_decided_request_cannot_be_decided_again(admin_client: Client, vera: AbstractBaseUser) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "x"})
    request = OrganizerRequest.objects.get()
    admin_client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "refuse"})

    response = admin_client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "grant"}, follow=True)

    request.refresh_from_db()
    assert request.decision == OrganizerRequest.Decision.REFUSED and not is_organizer(vera)
    assert "already refused" in str(list(response.context["messages"])[-1])


def test_an_unknown_decision_changes_nothing(admin_client: Client, vera: AbstractBaseUser) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "x"})
    request = OrganizerRequest.objects.get()

    response = admin_client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "maybe"}, follow=True)

    request.refresh_from_db()
    assert request.decision == OrganizerRequest.Decision.PENDING
    assert "Unknown decision 'maybe'" in str(list(response.context["messages"])[-1])


@pytest.mark.parametrize("who", ["volunteer", "organizer"])
def test_only_admins_see_and_decide_requests(vera: AbstractBaseUser, who: str) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "x"})
    request = OrganizerRequest.objects.get()
    client = logged_in(make_volunteer("mallory") if who == "volunteer" else make_organizer("otto"))

    listed = client.get("/organizers/requests")
    decided = client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "grant"})

    request.refresh_from_db()
    assert listed.status_code == 403 and decided.status_code == 403
    assert request.decision == OrganizerRequest.Decision.PENDING and not is_organizer(vera)


def test_anonymous_visitors_are_sent_to_log_in() -> None:
    for page in ("/organizers/request", "/organizers/requests"):
        response = Client().get(page)

        assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


def test_an_admin_grants_from_the_django_admin(vera: AbstractBaseUser) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "x"})
    request = OrganizerRequest.objects.get()
    superuser = make_admin("root")
    superuser.is_superuser = True
    superuser.save(update_fields=["is_superuser"])

    logged_in(superuser).post(
        "/admin/campaigns/organizerrequest/", {"action": "grant", "_selected_action": [request.pk]}
    )

    request.refresh_from_db()
    assert request.decision == OrganizerRequest.Decision.GRANTED and is_organizer(vera)


def test_the_staff_page_decides_with_the_csrf_token_only(vera: AbstractBaseUser) -> None:
    logged_in(vera).post("/organizers/request", {"reason": "x"})
    request = OrganizerRequest.objects.get()
    client = logged_in(make_admin("ada"), enforce_csrf_checks=True)

    response = client.post(f"/organizers/requests/{request.pk}/decide", {"decision": "grant"})

    assert response.status_code == 403 and not is_organizer(vera)


def test_the_profile_page_offers_the_request(vera: AbstractBaseUser) -> None:
    html = logged_in(vera).get("/me/").content.decode()

    assert 'href="/organizers/request"' in html

"""A superuser made with createsuperuser logs in on /accounts/login/ by e-mail, with no verification mail."""

from __future__ import annotations

import pytest
from allauth.account.models import EmailAddress
from django.contrib.auth import get_user_model
from django.core import mail
from django.core.management import call_command
from django.test import Client

from tests.factories import make_volunteer

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"


def test_createsuperuser_makes_an_account_that_logs_in_on_the_sites_login_page(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", PASSWORD)
    call_command("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.org")
    browser = Client()

    response = browser.post("/accounts/login/", {"login": "root@example.org", "password": PASSWORD})

    assert response.status_code == 302 and response["Location"] == "/"
    assert browser.get("/me/").status_code == 200
    assert not mail.outbox  # no "confirm your address" on the way
    assert EmailAddress.objects.get(email="root@example.org").verified


def test_a_superuser_does_not_take_an_address_a_volunteer_already_holds() -> None:
    volunteer = make_volunteer("vera")
    get_user_model().objects.create_superuser("root", "vera@example.org", PASSWORD)

    assert [a.user_id for a in EmailAddress.objects.filter(email="vera@example.org")] == [volunteer.pk]

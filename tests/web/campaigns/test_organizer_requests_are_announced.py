"""Organizer requests reach people: staff get an e-mail and a badge for each new one, the volunteer the outcome."""

from __future__ import annotations

from typing import Any

import pytest
from django.core import mail

from crowdtrain.campaigns.models import OrganizerRequest
from tests.factories import logged_in, make_admin, make_volunteer

pytestmark = pytest.mark.django_db


def ask(volunteer: Any, reason: str = "A small GPT on Shakespeare for my class.") -> None:
    logged_in(volunteer).post("/organizers/request", {"reason": reason})


def test_a_new_request_is_mailed_to_every_admin_once() -> None:
    make_admin("ada")
    make_admin("grace")
    vera = make_volunteer("vera")

    ask(vera)
    ask(vera, "Asked twice.")

    assert len(mail.outbox) == 1
    sent = mail.outbox[0]
    assert sorted(sent.to) == ["ada@example.org", "grace@example.org"]
    assert sent.subject == "[Crowdtrain] vera@example.org asks to become an organizer"
    assert "A small GPT on Shakespeare" in sent.body and "http://testserver/organizers/requests" in sent.body


def test_staff_see_the_number_of_waiting_requests_on_every_page() -> None:
    admin = make_admin("ada")
    ask(make_volunteer("vera"))
    ask(make_volunteer("otto"))

    staff_page = logged_in(admin).get("/leaderboards/").content.decode()
    volunteer_page = logged_in(make_volunteer("max")).get("/leaderboards/").content.decode()

    assert 'data-testid="pending-organizer-requests">2<' in staff_page
    assert "pending-organizer-requests" not in volunteer_page


@pytest.mark.parametrize(
    ("decision", "subject", "link"),
    [
        ("grant", "[Crowdtrain] You are now an organizer", "http://testserver/campaigns/"),
        ("refuse", "[Crowdtrain] Your organizer request was refused", "http://testserver/organizers/request"),
    ],
)
def test_the_volunteer_is_mailed_the_outcome(decision: str, subject: str, link: str) -> None:
    admin = make_admin("ada")
    ask(make_volunteer("vera"))
    row = OrganizerRequest.objects.get()
    mail.outbox.clear()

    logged_in(admin).post(f"/organizers/requests/{row.pk}/decide", {"decision": decision})

    assert [(m.to, m.subject) for m in mail.outbox] == [(["vera@example.org"], subject)]
    assert link in mail.outbox[0].body


def test_a_failing_mail_server_does_not_undo_the_request(settings: Any) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 1  # nothing listens
    make_admin("ada")

    ask(make_volunteer("vera"))

    assert OrganizerRequest.objects.filter(decision="pending").count() == 1

from __future__ import annotations

import pytest
from django.test import Client

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile
from tests.factories import make_user, make_volunteer

pytestmark = pytest.mark.django_db


def test_every_new_user_gets_a_profile() -> None:
    user = make_user("owner")

    assert Profile.objects.filter(user=user).count() == 1


def test_a_volunteer_sets_the_name_public_pages_show(client: Client) -> None:
    owner = make_volunteer("owner")
    client.force_login(owner)

    response = client.post("/me/", {"display_name": "Ada L."})

    assert response.status_code == 302
    assert Profile.of(owner).public_name == "Ada L."
    assert "Ada L." in client.get("/me/").content.decode()


def test_an_anonymous_volunteer_appears_as_anonymous(client: Client) -> None:
    owner = make_volunteer("owner")
    client.force_login(owner)

    client.post("/me/", {"display_name": "Ada L.", "anonymous": "on"})

    profile = Profile.of(owner)
    assert profile.display_name == "Ada L."  # kept for when they stop hiding
    assert profile.public_name == ANONYMOUS_NAME


def test_without_a_display_name_the_public_name_hides_the_address() -> None:
    owner = make_volunteer("owner")

    public_name = Profile.of(owner).public_name

    assert "owner" not in public_name
    assert public_name == f"Volunteer {owner.pk}"


@pytest.mark.parametrize(
    "bad_name", ["<script>", "anonymous VOLUNTEER", "Anonymous volunteer.", "Volunteer 2", "volunteer-17", "a" * 41]
)
def test_a_display_name_that_cannot_be_shown_is_refused(client: Client, bad_name: str) -> None:
    client.force_login(make_volunteer("owner"))

    response = client.post("/me/", {"display_name": bad_name})

    assert response.status_code == 200
    assert response.context["form"].errors["display_name"]
    assert Profile.objects.get(user__username="owner").display_name == ""


def test_the_profile_page_sends_strangers_to_log_in(client: Client) -> None:
    response = client.get("/me/")

    assert response.status_code == 302
    assert response.url == "/accounts/login/?next=/me/"

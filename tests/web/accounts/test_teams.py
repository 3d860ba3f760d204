from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.accounts.models import ANONYMOUS_NAME, Profile, Team
from crowdtrain.accounts.teams import create_team
from tests.factories import logged_in

pytestmark = pytest.mark.django_db


@pytest.fixture
def team(owner: AbstractBaseUser) -> Team:
    return create_team(owner, "Gradient Gardeners")


def _team_of(user: AbstractBaseUser) -> Team | None:
    return Profile.objects.select_related("team").get(user=user).team


def test_a_volunteer_creates_a_team_and_becomes_its_first_member(owner: AbstractBaseUser) -> None:
    response = logged_in(owner).post("/teams/new", {"name": "Gradient Gardeners", "description": "We prune."})

    team = Team.objects.get()
    assert response.url == "/teams/gradient-gardeners/"
    assert team.created_by == owner
    assert _team_of(owner) == team


def test_team_names_are_unique_whatever_their_case(team: Team, stranger: AbstractBaseUser) -> None:
    response = logged_in(stranger).post("/teams/new", {"name": "GRADIENT gardeners"})

    assert response.status_code == 200
    assert "already exists" in response.context["form"].errors["name"][0]
    assert Team.objects.count() == 1


def test_a_teammate_joins_through_the_invite_link(team: Team, teammate: AbstractBaseUser) -> None:
    client = logged_in(teammate)

    confirm = client.get(f"/teams/join/{team.invite_code}")
    response = client.post(f"/teams/join/{team.invite_code}")

    assert confirm.status_code == 200
    assert response.url == team.get_absolute_url()
    assert _team_of(teammate) == team


def test_opening_the_invite_link_does_not_join(team: Team, teammate: AbstractBaseUser) -> None:
    response = logged_in(teammate).get(f"/teams/join/{team.invite_code}")

    assert b"Join Gradient Gardeners" in response.content
    assert _team_of(teammate) is None


def test_joining_needs_a_csrf_token(team: Team, teammate: AbstractBaseUser) -> None:
    response = logged_in(teammate, enforce_csrf_checks=True).post(f"/teams/join/{team.invite_code}")

    assert response.status_code == 403
    assert _team_of(teammate) is None


def test_members_see_the_invite_link_and_strangers_do_not(
    team: Team, teammate: AbstractBaseUser, stranger: AbstractBaseUser
) -> None:
    logged_in(teammate).post(f"/teams/join/{team.invite_code}")

    member_page = logged_in(teammate).get(team.get_absolute_url()).content.decode()
    stranger_page = logged_in(stranger).get(team.get_absolute_url()).content.decode()
    visitor_page = Client().get(team.get_absolute_url()).content.decode()

    assert team.invite_code in member_page
    assert team.invite_code not in stranger_page
    assert team.invite_code not in visitor_page
    assert "Gradient Gardeners" in stranger_page


def test_the_team_page_lists_anonymous_members_as_anonymous(team: Team, teammate: AbstractBaseUser) -> None:
    Profile.objects.filter(user=teammate).update(display_name="Grace H.", anonymous=True)
    logged_in(teammate).post(f"/teams/join/{team.invite_code}")

    page = Client().get(team.get_absolute_url()).content.decode()

    assert ANONYMOUS_NAME in page
    assert "Grace H." not in page
    assert "teammate" not in page


def test_a_visitor_is_sent_to_log_in_and_then_back_to_the_invite(team: Team, teammate: AbstractBaseUser) -> None:
    client = Client()
    invite = f"/teams/join/{team.invite_code}"

    to_login = client.get(invite)
    after_login = client.post(to_login.url, {"login": "teammate@example.org", "password": "correct horse battery"})

    assert to_login.url == f"/accounts/login/?next={invite}"
    assert after_login.url == invite
    assert _team_of(teammate) is None


def test_joining_another_team_asks_to_leave_the_current_one(team: Team, stranger: AbstractBaseUser) -> None:
    other = create_team(stranger, "Tensor Tinkerers")
    client = logged_in(stranger)

    unconfirmed = client.post(f"/teams/join/{team.invite_code}")
    still_in = _team_of(stranger)
    client.post(f"/teams/join/{team.invite_code}", {"leave_current": "yes"})

    assert "Leave Tensor Tinkerers and join Gradient Gardeners" in unconfirmed.content.decode()
    assert still_in == other
    assert _team_of(stranger) == team


def test_a_member_leaves_their_team(team: Team, owner: AbstractBaseUser) -> None:
    client = logged_in(owner)

    refused_get = client.get(f"/teams/{team.slug}/leave")
    client.post(f"/teams/{team.slug}/leave")

    assert refused_get.status_code == 405
    assert _team_of(owner) is None
    assert Team.objects.filter(pk=team.pk).exists()


def test_a_new_invite_link_kills_the_old_one(team: Team, owner: AbstractBaseUser, teammate: AbstractBaseUser) -> None:
    old_code = team.invite_code

    logged_in(owner).post(f"/teams/{team.slug}/invite")
    dead = logged_in(teammate).post(f"/teams/join/{old_code}")

    team.refresh_from_db()
    assert team.invite_code != old_code
    assert dead.status_code == 404
    assert b"This invite link does not work" in dead.content
    assert _team_of(teammate) is None


def test_only_the_creator_makes_a_new_invite_link(team: Team, teammate: AbstractBaseUser) -> None:
    logged_in(teammate).post(f"/teams/join/{team.invite_code}")
    old_code = team.invite_code

    response = logged_in(teammate).post(f"/teams/{team.slug}/invite")

    team.refresh_from_db()
    assert response.status_code == 403
    assert team.invite_code == old_code


def test_a_made_up_invite_code_is_a_clear_404(stranger: AbstractBaseUser) -> None:
    response = logged_in(stranger).get("/teams/join/not-a-real-code")

    assert response.status_code == 404
    assert b"Ask a member of the team for the current link" in response.content


def test_a_team_named_like_a_fixed_page_gets_another_slug(owner: AbstractBaseUser) -> None:
    team = create_team(owner, "New")

    assert team.slug == "new-2"
    assert logged_in(owner).get("/teams/new-2/").status_code == 200

"""Who sees and manages which campaign: owner, another organizer, a volunteer, an admin, a stranger."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from tests.factories import logged_in, make_admin, make_campaign, make_organizer, make_persona, make_volunteer

pytestmark = pytest.mark.django_db

PAGES = ["/campaigns/{id}/", "/campaigns/{id}/edit"]


@pytest.fixture
def owner() -> AbstractBaseUser:
    return make_organizer("olga")


@pytest.fixture
def campaign(owner: AbstractBaseUser) -> Campaign:
    campaign = make_campaign(max_steps=100)
    Campaign.objects.filter(pk=campaign.pk).update(owner=owner, name="Olga's run")
    return Campaign.objects.get(pk=campaign.pk)


@pytest.mark.parametrize("page", PAGES)
def test_the_owner_opens_their_campaign_pages(owner: AbstractBaseUser, campaign: Campaign, page: str) -> None:
    response = logged_in(owner).get(page.format(id=campaign.pk))

    assert response.status_code == 200 and "Olga&#x27;s run" in response.content.decode()


@pytest.mark.parametrize(("who", "status"), [("other organizer", 404), ("volunteer", 403), ("admin", 200)])
def test_other_people_get_what_their_role_allows(campaign: Campaign, who: str, status: int) -> None:
    response = logged_in(make_persona(who)).get(f"/campaigns/{campaign.pk}/edit")

    assert response.status_code == status


@pytest.mark.parametrize("who", ["other organizer", "volunteer", "anonymous"])
def test_a_guessed_campaign_address_leads_others_to_its_public_page(campaign: Campaign, who: str) -> None:
    response = logged_in(make_persona(who)).get(f"/campaigns/{campaign.pk}/")

    assert response.status_code == 302 and response["Location"] == f"/campaigns/{campaign.pk}/join"


def test_an_admin_manages_any_campaign_at_its_address(campaign: Campaign) -> None:
    response = logged_in(make_admin("ada")).get(f"/campaigns/{campaign.pk}/")

    assert response.status_code == 200 and "Lifecycle" in response.content.decode()


@pytest.mark.parametrize(("who", "status"), [("other organizer", 404), ("volunteer", 404), ("anonymous", 302)])
def test_a_draft_stays_hidden_from_whoever_does_not_manage_it(campaign: Campaign, who: str, status: int) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.DRAFT)

    response = logged_in(make_persona(who)).get(f"/campaigns/{campaign.pk}/")

    assert response.status_code == status
    assert status != 302 or response["Location"].startswith("/accounts/login/")


@pytest.mark.parametrize("page", ["/campaigns/{id}/edit", "/campaigns/", "/campaigns/new"])
def test_anonymous_visitors_are_sent_to_log_in(campaign: Campaign, page: str) -> None:
    response = Client().get(page.format(id=campaign.pk))

    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


@pytest.mark.parametrize("page", ["/campaigns/", "/campaigns/new"])
def test_a_volunteer_is_told_to_request_the_organizer_role(page: str) -> None:
    response = logged_in(make_volunteer("vera")).get(page)

    assert response.status_code == 403
    html = response.content.decode()
    assert "Request the organizer role" in html and 'action="/organizers/request"' in html


def test_organizers_list_only_their_own_campaigns_and_admins_all(campaign: Campaign) -> None:
    otto = make_organizer("otto")
    theirs = make_campaign()
    Campaign.objects.filter(pk=theirs.pk).update(owner=otto, name="Otto's run")

    mine = logged_in(otto).get("/campaigns/").content.decode()
    everything = logged_in(make_admin("ada")).get("/campaigns/").content.decode()

    assert "Otto&#x27;s run" in mine and "Olga&#x27;s run" not in mine
    assert "Otto&#x27;s run" in everything and "Olga&#x27;s run" in everything


@pytest.mark.parametrize(("who", "status"), [("other organizer", 404), ("volunteer", 403), ("anonymous", 302)])
def test_lifecycle_posts_by_others_change_nothing(campaign: Campaign, who: str, status: int) -> None:
    response = logged_in(make_persona(who)).post(f"/campaigns/{campaign.pk}/lifecycle", {"action": "pause"})

    campaign.refresh_from_db()
    assert response.status_code == status
    assert campaign.state == Campaign.State.RUNNING


@pytest.mark.parametrize("action", ["pause", "finish"])
def test_the_owner_and_an_admin_can_move_the_campaign(owner: AbstractBaseUser, campaign: Campaign, action: str) -> None:
    for user in (owner, make_admin(f"ada-{action}")):
        Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING)

        logged_in(user).post(f"/campaigns/{campaign.pk}/lifecycle", {"action": action, "confirmed": "yes"})

        campaign.refresh_from_db()
        assert campaign.state != Campaign.State.RUNNING


@pytest.mark.parametrize(("who", "status"), [("other organizer", 404), ("volunteer", 403), ("anonymous", 302)])
def test_edits_by_others_change_nothing(campaign: Campaign, who: str, status: int) -> None:
    response = logged_in(make_persona(who)).post(f"/campaigns/{campaign.pk}/edit", {"name": "Hijacked", "max_steps": 5})

    campaign.refresh_from_db()
    assert response.status_code == status and campaign.name == "Olga's run"


@pytest.mark.parametrize(("who", "status"), [("other organizer", 404), ("volunteer", 403)])
def test_only_the_owner_can_replace_the_invite_link(campaign: Campaign, who: str, status: int) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(visibility="invite", invite_code="secret-code")

    response = logged_in(make_persona(who)).post(f"/campaigns/{campaign.pk}/invite")

    campaign.refresh_from_db()
    assert response.status_code == status and campaign.invite_code == "secret-code"


def test_lifecycle_posts_need_the_csrf_token(owner: AbstractBaseUser, campaign: Campaign) -> None:
    client = logged_in(owner, enforce_csrf_checks=True)

    response = client.post(f"/campaigns/{campaign.pk}/lifecycle", {"action": "pause"})

    campaign.refresh_from_db()
    assert response.status_code == 403 and campaign.state == Campaign.State.RUNNING


def test_the_campaign_form_needs_the_csrf_token(owner: AbstractBaseUser, campaign: Campaign) -> None:
    client = logged_in(owner, enforce_csrf_checks=True)

    response = client.post(f"/campaigns/{campaign.pk}/edit", {"name": "No token"})

    campaign.refresh_from_db()
    assert response.status_code == 403 and campaign.name == "Olga's run"


def test_a_volunteer_with_the_invite_link_becomes_invited(owner: AbstractBaseUser, campaign: Campaign) -> None:
    owner_client = logged_in(owner)
    owner_client.post(
        f"/campaigns/{campaign.pk}/edit",
        {
            "name": campaign.name,
            "visibility": "invite",
            "max_steps": 100,
            "dataset": campaign.dataset_id,
        },
    )
    campaign.refresh_from_db()
    vera = make_volunteer("vera")
    vera_client = logged_in(vera)

    shown = vera_client.get(f"/campaigns/invite/{campaign.invite_code}")
    open_before = campaign.is_open_to(vera)
    accepted = vera_client.post(f"/campaigns/invite/{campaign.invite_code}")

    assert shown.status_code == 200 and not open_before
    assert accepted.status_code == 302 and accepted["Location"] == f"/campaigns/{campaign.pk}/join"
    assert campaign.is_open_to(vera) and not campaign.is_open_to(make_volunteer("stranger"))


def test_a_replaced_or_wrong_invite_link_is_refused(owner: AbstractBaseUser, campaign: Campaign) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(visibility="invite", invite_code="old-code")
    logged_in(owner).post(f"/campaigns/{campaign.pk}/invite")
    vera_client = logged_in(make_volunteer("vera"))

    old = vera_client.post("/campaigns/invite/old-code")
    anonymous = Client().get(f"/campaigns/invite/{Campaign.objects.get(pk=campaign.pk).invite_code}")

    assert old.status_code == 404 and campaign.invited.count() == 0
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")


def test_the_public_page_lists_public_campaigns_only(campaign: Campaign) -> None:
    hidden = make_campaign()
    Campaign.objects.filter(pk=hidden.pk).update(name="Secret run", visibility="invite", invite_code="c0de")

    html = Client().get("/").content.decode()

    assert "Olga&#x27;s run" in html and "Secret run" not in html


@pytest.mark.parametrize(
    ("who", "visibility", "state", "visible"),
    [
        ("anonymous", "public", "running", True),
        ("anonymous", "public", "draft", False),
        ("volunteer", "invite", "running", False),
        ("invited", "invite", "running", True),
        ("other organizer", "invite", "paused", False),
        ("owner", "invite", "draft", True),
        ("admin", "invite", "draft", True),
    ],
)
def test_progress_and_join_pages_show_only_what_a_persona_may_watch(
    campaign: Campaign, owner: AbstractBaseUser, who: str, visibility: str, state: str, visible: bool
) -> None:
    Campaign.objects.filter(pk=campaign.pk).update(visibility=visibility, state=state)
    if who == "owner":
        user = owner
    elif who == "invited":
        user = make_volunteer("ivy")
        campaign.invited.add(user)
    else:
        user = make_persona(who)
    client = logged_in(user)

    progress = client.get(f"/api/campaigns/{campaign.pk}/progress")
    join = client.get(f"/campaigns/{campaign.pk}/join")

    assert progress.status_code == (200 if visible else 404)
    if state != "draft":  # the join page is never shown for drafts, even to their owner
        assert join.status_code == (200 if visible else 404)

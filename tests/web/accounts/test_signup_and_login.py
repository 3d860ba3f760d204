from __future__ import annotations

import re
from typing import Any

import pytest
from django.core import mail
from django.test import Client, override_settings

from crowdtrain.accounts.models import Profile
from tests.factories import make_volunteer

pytestmark = pytest.mark.django_db

PASSWORD = "violet-gradient-42"


def _link_in_last_mail() -> str:
    match = re.search(r"http://testserver(/\S+)", mail.outbox[-1].body)
    assert match, mail.outbox[-1].body
    return match.group(1)


def _logged_in_user_id(client: Client) -> str | None:
    return client.session.get("_auth_user_id")


def _sign_up(client: Client, email: str, password: str = PASSWORD) -> None:
    client.post("/accounts/signup/", {"email": email, "password1": password, "password2": password})


def test_a_volunteer_signs_up_verifies_their_address_and_logs_in(client: Client) -> None:
    _sign_up(client, "ada@example.org")
    confirm_url = _link_in_last_mail()
    confirm_page = client.get(confirm_url)
    client.post(confirm_url)
    response = client.post("/accounts/login/", {"login": "ada@example.org", "password": PASSWORD})

    assert mail.outbox[0].to == ["ada@example.org"]
    assert confirm_page.status_code == 200
    assert response.status_code == 302
    assert _logged_in_user_id(client) is not None
    assert Profile.objects.filter(user__email="ada@example.org").exists()


def test_login_is_refused_until_the_address_is_verified(client: Client) -> None:
    _sign_up(client, "ada@example.org")
    client.logout()

    response = client.post("/accounts/login/", {"login": "ada@example.org", "password": PASSWORD})

    assert _logged_in_user_id(client) is None
    assert response.url == "/accounts/confirm-email/"  # "we sent you a verification mail"


@pytest.mark.parametrize("contact", ["", "help@crowdtrain.example"])
def test_pages_that_promise_help_name_the_contact_address_or_what_to_do_instead(
    client: Client, settings: Any, contact: str
) -> None:
    # Issue 34: "contact us if you do not receive the verification email", with no contact anywhere.
    settings.CROWDTRAIN_CONTACT_EMAIL = contact
    _sign_up(client, "ada@example.org")
    client.logout()

    pages = [client.get("/accounts/confirm-email/"), client.get("/accounts/password/reset/")]

    for page in pages:
        html = page.content.decode()
        assert page.status_code == 200 and "contact us" not in html.lower()
        if contact:
            assert f'href="mailto:{contact}"' in html
        else:
            assert "mailto:" not in html
    if not contact:
        assert "sign in with your address and password: the site sends a new link" in pages[0].content.decode()


def test_signing_up_from_a_join_page_comes_back_to_it_logged_in_after_confirming(client: Client) -> None:
    # Issue 34: after confirming she was logged out on Sign In, and after signing in she landed on Home.
    from tests.factories import make_campaign

    campaign = make_campaign()
    join = f"/campaigns/{campaign.pk}/join"
    html = client.get(join).content.decode()
    assert f'href="/accounts/signup/?next={join}"' in html, "the Sign up link keeps the page"

    client.post(f"/accounts/signup/?next={join}", {"email": "ada@example.org", "password1": PASSWORD,
                                                  "password2": PASSWORD, "next": join})  # fmt: skip
    assert _logged_in_user_id(client) is None, "not before the address is confirmed"
    confirmed = client.post(_link_in_last_mail())

    assert _logged_in_user_id(client) is not None
    assert confirmed.status_code == 302 and confirmed.url == join


def test_the_confirmation_page_names_the_address_not_a_made_up_username(client: Client) -> None:
    from django.contrib.auth import get_user_model

    _sign_up(client, "ada@example.org")
    page = client.get(_link_in_last_mail()).content.decode()

    username = get_user_model().objects.get(email="ada@example.org").username
    assert "Please confirm that" in page and "ada@example.org" in page
    assert username not in page.replace("ada@example.org", ""), "the username the site made up is not shown"


def test_the_footer_says_cpus_and_gpus(client: Client) -> None:
    assert "spare CPUs and GPUs" in client.get("/").content.decode()


def test_a_forgotten_password_is_reset_by_mail(client: Client) -> None:
    make_volunteer("owner", password=PASSWORD)

    client.post("/accounts/password/reset/", {"email": "owner@example.org"})
    form_url = client.get(_link_in_last_mail()).url  # the key moves to the session, out of the URL
    client.post(form_url, {"password1": "new-indigo-tensor-7", "password2": "new-indigo-tensor-7"})
    old = client.post("/accounts/login/", {"login": "owner@example.org", "password": PASSWORD})
    new = client.post("/accounts/login/", {"login": "owner@example.org", "password": "new-indigo-tensor-7"})

    assert "password you specified are not correct" in old.content.decode()
    assert new.status_code == 302
    assert _logged_in_user_id(client) is not None


def test_a_weak_password_is_refused_with_djangos_message(client: Client) -> None:
    response = client.post("/accounts/signup/", {"email": "ada@example.org", "password1": "password",
                                                 "password2": "password"})  # fmt: skip

    assert response.status_code == 200
    assert "This password is too common." in response.content.decode()
    assert mail.outbox == []


@override_settings(ACCOUNT_RATE_LIMITS={"login_failed": "10/m/ip,3/m/key"})
def test_logins_are_throttled_after_repeated_failures(client: Client) -> None:
    make_volunteer("owner", password=PASSWORD)
    for _ in range(3):
        client.post("/accounts/login/", {"login": "owner@example.org", "password": "guess"})

    response = client.post("/accounts/login/", {"login": "owner@example.org", "password": PASSWORD})

    assert _logged_in_user_id(client) is None
    assert "Too many failed login attempts" in response.content.decode()


def test_logging_out_takes_a_post(client: Client) -> None:
    owner = make_volunteer("owner")
    client.force_login(owner)

    client.get("/accounts/logout/")
    still_in = _logged_in_user_id(client)
    client.post("/accounts/logout/")

    assert still_in == str(owner.pk)
    assert _logged_in_user_id(client) is None


def test_the_login_page_wears_the_site_layout(client: Client) -> None:
    response = client.get("/accounts/login/")

    page = response.content.decode()
    assert 'class="site-nav"' in page
    assert "css/site.css" in page
    assert 'href="/accounts/signup/"' in page


def test_the_site_has_an_icon(client: Client) -> None:
    # Issue 34: /favicon.ico was 404 on every page.
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response.url.endswith("img/favicon.svg")
    assert 'rel="icon"' in client.get("/").content.decode()

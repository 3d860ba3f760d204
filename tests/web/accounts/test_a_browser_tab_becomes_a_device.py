"""``POST /devices/tab/``: a logged-in volunteer's tab gets a device and a token; My devices shows and revokes it.

Every refusal is JSON in words a page's script can show, and a script cannot
mint devices without end: each volunteer and each address are throttled.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client, override_settings

from crowdtrain.accounts.models import Device
from crowdtrain.accounts.tokens import hash_token
from crowdtrain.campaigns.models import Campaign
from crowdtrain.devices.tab_views import tab_device_name
from tests.factories import logged_in, make_campaign

pytestmark = pytest.mark.django_db

CHROMIUM_LINUX = "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/156.0.0.0 Safari/537.36"


def _page_client(user: AbstractBaseUser) -> tuple[Client, str]:
    """A client that checks CSRF as a browser's requests are checked, and the token its page would send."""
    client = logged_in(user, enforce_csrf_checks=True)
    client.get("/devices/")  # any page with a form sets the csrftoken cookie
    return client, client.cookies["csrftoken"].value


def _ask(user: AbstractBaseUser, body: Any = None, *, raw: bytes | None = None) -> Any:
    client, csrf = _page_client(user)
    data = raw if raw is not None else ("" if body is None else json.dumps(body))
    return client.post(
        "/devices/tab/", data, content_type="application/json", HTTP_X_CSRFTOKEN=csrf,
        HTTP_USER_AGENT=CHROMIUM_LINUX,
    )  # fmt: skip


def test_a_logged_in_tab_gets_a_device_and_a_token_shown_once(owner: AbstractBaseUser) -> None:
    campaign = make_campaign()

    answer = _ask(owner, {"campaign_id": campaign.pk})

    assert answer.status_code == 201 and answer["Cache-Control"] == "no-store"
    body = answer.json()
    assert set(body) == {"device_id", "token", "name"}
    device = Device.objects.get(pk=body["device_id"])
    assert device.owner_id == owner.pk and body["name"] == device.name == "Chrome tab on Linux"
    assert body["token"].startswith("ctd_") and len(body["token"]) == 47
    assert device.token_hash == hash_token(body["token"]) and Device.authenticate(body["token"]) == device
    assert device.hardware == {"kind": "browser", "name": "Chrome tab on Linux"}
    # Without a body: no campaign in particular.
    assert _ask(owner).status_code == 201


def test_a_visitor_not_logged_in_or_a_get_is_refused_in_json(client: Client) -> None:
    anonymous = client.post("/devices/tab/", "{}", content_type="application/json")
    got = logged_in(None).get("/devices/tab/")

    assert anonymous.status_code == 401 and "log in" in anonymous.json()["error"]
    assert got.status_code == 405 and got["Allow"] == "POST" and "POST" in got.json()["error"]
    assert not Device.objects.exists()


def test_a_post_without_the_csrf_header_is_refused_in_json(owner: AbstractBaseUser) -> None:
    client, _ = _page_client(owner)

    answer = client.post("/devices/tab/", "{}", content_type="application/json")

    assert answer.status_code == 403 and "X-CSRFToken" in answer.json()["error"]
    assert not Device.objects.exists()


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"{campaign", "not valid JSON"),
        (b"[3]", "must be a JSON object"),
        (b'{"campaign_id": "3"}', "campaign_id must be an integer, got '3'"),
        (b'{"campaign_id": true}', "campaign_id must be an integer"),
        (b'{"campaign_id": 0}', "campaign_id must be an integer >= 1"),
        (b'{"campaign_id": 1e400}', "campaign_id must be an integer"),
        (b'{"campaign_id": 99999999999999999999999}', "campaign_id must be an integer"),
        (b'{"campaign_id": 3, "name": "x"}', "unknown field 'name'"),
        (b'{"campaign_id": "\\ud800"}', "not text"),
        (b'{"x": "' + b"a" * 2000 + b'"}', "over 1024 bytes"),
    ],
)
def test_a_bad_body_is_refused_naming_what_is_wrong(owner: AbstractBaseUser, raw: bytes, problem: str) -> None:
    answer = _ask(owner, raw=raw)

    assert answer.status_code == 400 and problem in answer.json()["error"], answer.json()
    assert not Device.objects.exists()


def test_a_campaign_the_volunteer_may_not_join_is_refused_before_a_device_is_made(owner: AbstractBaseUser) -> None:
    invite_only = make_campaign(visibility=Campaign.Visibility.INVITE)
    finished = make_campaign()
    Campaign.objects.filter(pk=finished.pk).update(state=Campaign.State.FINISHED)
    draft = make_campaign()
    Campaign.objects.filter(pk=draft.pk).update(state=Campaign.State.DRAFT)

    for campaign_id in (invite_only.pk, draft.pk, 10**9):
        answer = _ask(owner, {"campaign_id": campaign_id})
        assert answer.status_code == 404 and f"no campaign {campaign_id} you may join" in answer.json()["error"]
    answer = _ask(owner, {"campaign_id": finished.pk})
    assert answer.status_code == 403 and "has finished" in answer.json()["error"]
    assert not Device.objects.exists()


@override_settings(CROWDTRAIN_TAB_DEVICES_PER_USER=3)
def test_a_script_cannot_mint_devices_without_end(owner: AbstractBaseUser, stranger: AbstractBaseUser) -> None:
    answers = [_ask(owner).status_code for _ in range(5)]
    refused = _ask(owner)

    assert answers == [201, 201, 201, 429, 429]
    assert refused["Retry-After"] == "600" and "wait 10 minutes" in refused.json()["error"]
    assert Device.objects.filter(owner_id=owner.pk).count() == 3
    assert _ask(stranger).status_code == 201, "another volunteer has a limit of their own"


@override_settings(CROWDTRAIN_DEVICE_CODES_PER_IP=2)
def test_tabs_count_against_the_address_as_agent_logins_do(owner: AbstractBaseUser, stranger: AbstractBaseUser) -> None:
    assert [_ask(user).status_code for user in (owner, stranger, stranger)] == [201, 201, 429]
    assert Client().post("/api/device/code", {"name": "box"}).status_code == 429


@pytest.mark.parametrize(
    ("agent", "name"),
    [
        (CHROMIUM_LINUX, "Chrome tab on Linux"),
        ("Mozilla/5.0 (X11; Linux x86_64) HeadlessChrome/156.0.0.0 Safari/537.36", "Chrome tab on Linux"),
        ("Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 Chrome/131.0 Safari/537.36 Edg/131.0",
         "Edge tab on Windows"),
        ("Mozilla/5.0 (Macintosh; Intel Mac OS X 14.5; rv:133.0) Gecko/20100101 Firefox/133.0", "Firefox tab on macOS"),
        ("Mozilla/5.0 (iPhone; CPU iPhone OS 17_5 like Mac OS X) Version/17.5 Mobile/15E148 Safari/604.1",
         "Safari tab on iOS"),
        ("", "Browser tab"),
        ("<script>alert(1)</script>\x00" * 500, "Browser tab"),
    ],
)  # fmt: skip
def test_a_tab_is_named_from_its_user_agent_in_words_of_our_own(agent: str, name: str) -> None:
    assert tab_device_name(agent) == name


def test_my_devices_shows_a_tab_as_a_browser_tab_with_its_runtime_and_revokes_it(owner: AbstractBaseUser) -> None:
    body = _ask(owner).json()
    device = Device.objects.get(pk=body["device_id"])
    # What its hello leaves (gateway.consumers._record_hello merges hello.device over the saved hardware).
    device.hardware = {**device.hardware, "name": "Chrome 156 on Linux", "runtime": "onnxruntime-web 1.30.0 wasm",
                       "threads": 1, "flops_per_s": 2.5e9, "torch_version": ""}  # fmt: skip
    device.save()
    client = logged_in(owner)

    html = client.get("/devices/").content.decode()
    revoked = client.post(f"/devices/{device.pk}/revoke")

    section = html[html.index(f'id="device-{device.pk}"') :]
    assert '<span class="badge badge-tab">browser tab</span>' in section[:800]
    assert "Chrome 156 on Linux (browser tab)" in section
    assert "<dt>Runtime</dt><dd>onnxruntime-web 1.30.0 wasm</dd>" in section
    assert "PyTorch" not in section[: section.index("Recent leases")]
    assert revoked.status_code == 302
    device.refresh_from_db()
    assert device.is_revoked and Device.authenticate(body["token"]) == device  # 4003 on its next connect

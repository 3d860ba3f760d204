"""Device-code login (RFC 8628): codes, polling, approval in the browser, and the agent's token endpoints."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpResponse
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device, DeviceAuthorization
from crowdtrain.accounts.tokens import hash_token
from crowdtrain.devices.grant import GRANT_TYPE
from tests.factories import logged_in, make_volunteer

pytestmark = pytest.mark.django_db

HARDWARE = {"hostname": "lab-box", "os": "Linux 6.8", "cpu_count": 16, "accelerator": "NVIDIA H100"}


def _start(client: Client, **fields: Any) -> dict[str, Any]:
    form = {"client_id": "crowdtrain-agent", "name": "lab-box", "hardware": json.dumps(HARDWARE), **fields}
    response = client.post("/api/device/code", form)
    assert response.status_code == 200, response.content
    return response.json()


def _poll(client: Client, device_code: str) -> HttpResponse:
    return client.post("/api/device/token", {"grant_type": GRANT_TYPE, "device_code": device_code})


def _allow_next_poll(user_code: str) -> None:
    """Move the last poll back in time, as if the agent had waited its interval."""
    row = DeviceAuthorization.objects.get(user_code=user_code.replace("-", ""))
    if row.last_polled_at is not None:
        row.last_polled_at -= timedelta(seconds=row.interval)
        row.save(update_fields=["last_polled_at"])


def _decide(user: AbstractBaseUser, user_code: str, decision: str, name: str = "desk gpu") -> HttpResponse:
    return logged_in(user).post("/device/confirm", {"user_code": user_code, "decision": decision, "name": name})


def test_an_agent_gets_a_code_pair_with_verification_addresses(client: Client) -> None:
    pair = _start(client)

    assert re.fullmatch(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}", pair["user_code"])
    assert pair["verification_uri"] == "http://testserver/device"
    assert pair["verification_uri_complete"] == f"http://testserver/device?user_code={pair['user_code']}"
    assert (pair["expires_in"], pair["interval"]) == (600, 5)
    assert len(pair["device_code"]) >= 43


def test_the_token_is_issued_once_to_the_approver_with_the_approved_name(
    client: Client, owner: AbstractBaseUser
) -> None:
    pair = _start(client)
    pending = _poll(client, pair["device_code"])

    _decide(owner, pair["user_code"], "approve", name="  desk   gpu ")
    _allow_next_poll(pair["user_code"])
    issued = _poll(client, pair["device_code"])
    replayed = _poll(client, pair["device_code"])

    body = issued.json()
    device = Device.objects.get()
    assert pending.status_code == 400 and pending.json()["error"] == "authorization_pending"
    assert issued.status_code == 200 and issued["Cache-Control"] == "no-store"
    assert body["token_type"] == "Bearer" and body["user"] == "owner@example.org"
    assert (body["device_id"], body["device_name"]) == (device.pk, "desk gpu")
    assert device.owner == owner and device.hardware == HARDWARE
    assert Device.authenticate(body["access_token"]) == device
    assert replayed.status_code == 400 and replayed.json()["error"] == "invalid_grant"


def test_polling_faster_than_the_interval_gets_slow_down_and_a_longer_interval(client: Client) -> None:
    pair = _start(client)

    first = _poll(client, pair["device_code"])
    second = _poll(client, pair["device_code"])

    assert first.json()["error"] == "authorization_pending"
    assert second.status_code == 400 and second.json()["error"] == "slow_down"
    assert DeviceAuthorization.objects.get().interval == 10


def test_a_denied_code_answers_access_denied_and_issues_nothing(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)

    page = _decide(owner, pair["user_code"], "deny")
    answer = _poll(client, pair["device_code"])

    assert b"Device denied" in page.content
    assert answer.status_code == 400 and answer.json()["error"] == "access_denied"
    assert not Device.objects.exists()


def test_an_expired_code_answers_expired_token_and_cannot_be_approved(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    DeviceAuthorization.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    page = _decide(owner, pair["user_code"], "approve")
    answer = _poll(client, pair["device_code"])

    assert page.status_code == 400 and b"has expired" in page.content
    assert answer.json()["error"] == "expired_token"
    assert DeviceAuthorization.objects.get().approved_by is None


def test_an_approved_code_expires_if_the_agent_never_collects_it(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    _decide(owner, pair["user_code"], "approve")
    DeviceAuthorization.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    answer = _poll(client, pair["device_code"])

    assert answer.json()["error"] == "expired_token"
    assert not Device.objects.exists()


def test_wrong_codes_are_refused_with_a_reason(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    browser = logged_in(owner)

    unknown_device_code = _poll(client, "not-a-device-code")
    malformed = browser.post("/device", {"user_code": "hello"})
    unknown = browser.post("/device", {"user_code": "BBBB-BBBB" if pair["user_code"] != "BBBB-BBBB" else "CCCC-CCCC"})

    assert unknown_device_code.status_code == 400 and unknown_device_code.json()["error"] == "invalid_grant"
    assert b"is not a device code" in malformed.content
    assert b"No device is waiting for code" in unknown.content


def test_a_used_code_cannot_be_approved_again(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    _decide(owner, pair["user_code"], "approve")

    again = _decide(make_volunteer("stranger"), pair["user_code"], "approve")

    assert b"was already used" in again.content
    assert DeviceAuthorization.objects.get().approved_by == owner


def test_user_codes_match_whatever_the_case_spaces_and_dashes(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    typed = pair["user_code"].lower().replace("-", " ")

    page = logged_in(owner).post("/device", {"user_code": typed})

    assert page.status_code == 200 and b"Approve this device?" in page.content
    assert pair["user_code"].encode() in page.content


def test_a_prefilled_link_shows_the_device_but_approves_nothing(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)

    page = logged_in(owner).get(pair["verification_uri_complete"].removeprefix("http://testserver"))

    assert b"Approve this device?" in page.content
    assert b"lab-box" in page.content and b"NVIDIA H100" in page.content
    assert DeviceAuthorization.objects.get().approved_by is None


def test_what_the_agent_reports_is_escaped_on_the_confirmation_page(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client, name="<script>alert(1)</script>", hardware=json.dumps({"os": "<img src=x onerror=alert(2)>"}))

    page = logged_in(owner).get(f"/device?user_code={pair['user_code']}")

    assert b"<script>alert(1)" not in page.content and b"&lt;script&gt;alert(1)" in page.content
    assert b"<img src=x" not in page.content


def test_device_codes_and_tokens_are_stored_only_hashed(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    _decide(owner, pair["user_code"], "approve")
    _allow_next_poll(pair["user_code"])

    token = _poll(client, pair["device_code"]).json()["access_token"]

    authorization_row = json.dumps(list(DeviceAuthorization.objects.values()), default=str)
    device_row = json.dumps(list(Device.objects.values()), default=str)
    for secret in (pair["device_code"], token):
        assert secret not in authorization_row and secret not in device_row
    assert hash_token(pair["device_code"]) in authorization_row
    assert hash_token(token) in device_row


def test_approving_and_denying_need_the_csrf_token(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)

    forged = logged_in(owner, enforce_csrf_checks=True).post(
        "/device/confirm", {"user_code": pair["user_code"], "decision": "approve", "name": "x"}
    )

    assert forged.status_code == 403
    assert DeviceAuthorization.objects.get().approved_by is None


def test_approval_checks_the_name(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)

    blank = _decide(owner, pair["user_code"], "approve", name="   ")
    too_long = _decide(owner, pair["user_code"], "approve", name="x" * 101)

    assert blank.status_code == 400 and b"the device name is empty" in blank.content
    assert too_long.status_code == 400 and b"use at most 100" in too_long.content
    assert DeviceAuthorization.objects.get().approved_by is None


def test_the_verification_page_needs_a_logged_in_volunteer(client: Client) -> None:
    pair = _start(client)

    page = client.get(f"/device?user_code={pair['user_code']}")

    assert page.status_code == 302 and "next=" in page["Location"]


def test_malformed_requests_get_oauth_errors(client: Client) -> None:
    pair = _start(client)

    wrong_grant = client.post("/api/device/token", {"grant_type": "password", "device_code": pair["device_code"]})
    no_code = client.post("/api/device/token", {"grant_type": GRANT_TYPE})
    twice = client.post("/api/device/token", f"grant_type={GRANT_TYPE}&device_code=a&device_code=b",
                        content_type="application/x-www-form-urlencoded")  # fmt: skip
    bad_client = client.post("/api/device/code", {"client_id": "evil-app"})
    not_an_object = client.post("/api/device/code", {"hardware": "[1, 2]"})
    nested = client.post("/api/device/code", {"hardware": json.dumps({"gpu": {"name": "x"}})})
    too_many = client.post("/api/device/code", {"hardware": json.dumps({f"k{i}": i for i in range(40)})})
    huge = client.post("/api/device/code", {"name": "x" * 9000})
    as_json = client.post("/api/device/code", {"name": "json-box", "hardware": {"cpu_count": 4}},
                          content_type="application/json")  # fmt: skip
    get = client.get("/api/device/code")

    assert wrong_grant.json()["error"] == "unsupported_grant_type"
    assert no_code.json()["error"] == "invalid_request"
    assert twice.json()["error"] == "invalid_request" and "more than once" in twice.json()["error_description"]
    assert bad_client.status_code == 401 and bad_client.json()["error"] == "invalid_client"
    assert not_an_object.json() == {"error": "invalid_request", "error_description": "hardware must be a JSON object"}
    assert nested.json()["error"] == "invalid_request" and "hardware.gpu" in nested.json()["error_description"]
    assert too_many.json()["error"] == "invalid_request"
    assert huge.status_code == 413 and huge.json()["error"] == "invalid_request"
    assert as_json.status_code == 200
    assert get.status_code == 405


def test_code_requests_are_rate_limited_per_client_address(client: Client, settings: Any) -> None:
    settings.CROWDTRAIN_DEVICE_CODES_PER_IP = 2
    _start(client)
    _start(client)

    third = client.post("/api/device/code", {"name": "one too many"})
    elsewhere = client.post("/api/device/code", {"name": "other lab"}, REMOTE_ADDR="10.0.0.7")

    assert third.status_code == 429 and third.json()["error"] == "slow_down"
    assert int(third["Retry-After"]) > 0
    assert elsewhere.status_code == 200


def test_wrong_user_codes_are_rate_limited_per_volunteer(
    client: Client, owner: AbstractBaseUser, settings: Any
) -> None:
    settings.CROWDTRAIN_USER_CODE_FAILURES = 2
    pair = _start(client)
    browser = logged_in(owner)
    wrong = "BBBB-BBBB" if pair["user_code"] != "BBBB-BBBB" else "CCCC-CCCC"
    browser.post("/device", {"user_code": wrong})
    browser.post("/device", {"user_code": wrong})

    right_but_late = browser.post("/device", {"user_code": pair["user_code"]})
    other_volunteer = logged_in(make_volunteer("stranger")).post("/device", {"user_code": pair["user_code"]})

    assert right_but_late.status_code == 429 and b"Too many codes" in right_but_late.content
    assert other_volunteer.status_code == 200


def test_whoami_and_logout_work_with_the_device_token_only(client: Client, owner: AbstractBaseUser) -> None:
    device, token = Device.issue(owner, "desk gpu")
    auth = {"Authorization": f"Bearer {token}"}

    me = client.get("/api/me", headers=auth)
    revoked = client.post("/api/device/revoke", headers=auth)
    me_after = client.get("/api/me", headers=auth)
    no_token = client.get("/api/me")

    assert me.json() == {
        "device_id": device.pk,
        "device_name": "desk gpu",
        "user": "owner@example.org",
        "server": "http://testserver",
    }
    assert revoked.json() == {"revoked": True, "device_id": device.pk}
    assert me_after.status_code == 401 and me_after["WWW-Authenticate"].startswith("Bearer")
    assert no_token.status_code == 401
    device.refresh_from_db()
    assert device.is_revoked


@pytest.mark.parametrize("body", [{"json": "[" * 5000}, {"form": {"hardware": "[" * 4000}}])
def test_json_nested_beyond_the_parser_is_a_clear_400_not_a_crash(client: Client, body: dict[str, Any]) -> None:
    if "json" in body:
        response = client.post("/api/device/code", body["json"], content_type="application/json")
    else:
        response = client.post("/api/device/code", body["form"])

    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"


def test_a_deactivated_volunteers_devices_stop_working(client: Client, owner: AbstractBaseUser) -> None:
    _, token = Device.issue(owner, "desk gpu")
    owner.is_active = False  # an admin banned them
    owner.save(update_fields=["is_active"])

    me = client.get("/api/me", headers={"Authorization": f"Bearer {token}"})

    assert me.status_code == 401
    assert Device.authenticate(token) is None  # what the agent channel and shard downloads ask too


def test_a_code_approved_by_a_since_deactivated_account_issues_nothing(client: Client, owner: AbstractBaseUser) -> None:
    pair = _start(client)
    _decide(owner, pair["user_code"], "approve")
    owner.is_active = False
    owner.save(update_fields=["is_active"])
    _allow_next_poll(pair["user_code"])

    refused = _poll(client, pair["device_code"])

    assert refused.status_code == 400 and refused.json()["error"] == "access_denied"
    assert not Device.objects.exists()

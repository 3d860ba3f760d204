"""My devices: only my own, with their hardware and state; rename and revoke, which disconnects the agent."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain.asgi import application
from crowdtrain.devices.grant import GRANT_TYPE
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain_agent.protocol import CloseCode, ControlsChanged, Welcome
from tests.factories import logged_in, make_user
from tests.web.gateway.conftest import HELLO, Connect, connect, receive, send  # noqa: F401  (connect: a fixture)

H100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_984, "threads": 16,
        "torch_version": "2.13.0", "flops_per_s": 5.1e14, "os": "Linux 6.8", "hostname": "lab-box"}  # fmt: skip


def _device(owner: AbstractBaseUser, name: str, *, seen_s_ago: float | None = 1.0, **fields: object) -> Device:
    device, _ = Device.issue(owner, name)
    if seen_s_ago is not None:  # as the site's housekeeping records a connected agent, and its lazy "last seen"
        device.last_seen_at = timezone.now() - timedelta(seconds=seen_s_ago)
        hot_state().mark_seen([device.pk], at=hot_state().clock() - seen_s_ago)
    for field, value in fields.items():
        setattr(device, field, value)
    device.save()
    return device


def _device_through_login(approver: AbstractBaseUser) -> tuple[Device, str]:
    """A device as `crowdtrain-agent login` makes it: code, approval in the browser, token."""
    agent = Client()
    pair = agent.post("/api/device/code", {"name": "lab-box"}).json()
    logged_in(approver).post(
        "/device/confirm", {"user_code": pair["user_code"], "decision": "approve", "name": "lab-box"}
    )
    token = agent.post("/api/device/token", {"grant_type": GRANT_TYPE, "device_code": pair["device_code"]})
    body = token.json()
    return Device.objects.get(pk=body["device_id"]), body["access_token"]


@pytest.mark.django_db
def test_the_page_lists_my_devices_with_hardware_speed_and_state(
    owner: AbstractBaseUser, stranger: AbstractBaseUser
) -> None:
    online = _device(owner, "desk gpu", hardware=H100, samples_per_s=412.5, samples_accepted=123456)
    _device(owner, "old laptop", seen_s_ago=settings.CROWDTRAIN_GONE_AFTER_S + 60)
    _device(owner, "sold box", revoked_at=timezone.now())
    _device(stranger, "someone else's rig")

    page = logged_in(owner).get("/devices/")

    html = page.content.decode()
    assert page.status_code == 200
    assert "desk gpu" in html and "old laptop" in html and "sold box" in html
    assert "someone else" not in html
    assert "NVIDIA H100 80GB HBM3 (cuda)" in html and "79.6 GiB" in html and "510.0 TFLOP/s" in html
    assert "412.5 samples/s" in html and "123456" in html and "Linux 6.8" in html
    section = html[html.index(f'id="device-{online.pk}"') :]
    assert "online now" in section[:600]
    assert html.count("online now") == 1 and html.count("badge-revoked") == 1


@pytest.mark.django_db
def test_a_device_approved_by_one_volunteer_is_invisible_and_untouchable_to_another(
    owner: AbstractBaseUser, stranger: AbstractBaseUser
) -> None:
    device, _ = _device_through_login(owner)
    browser = logged_in(stranger)

    page = browser.get("/devices/")
    rename = browser.post(f"/devices/{device.pk}/rename", {"name": "mine now"})
    revoke = browser.post(f"/devices/{device.pk}/revoke")

    assert device.owner == owner
    assert "lab-box" not in page.content.decode()
    assert rename.status_code == 404 and revoke.status_code == 404
    device.refresh_from_db()
    assert device.name == "lab-box" and not device.is_revoked


@pytest.mark.django_db
def test_renaming_checks_the_new_name(owner: AbstractBaseUser) -> None:
    device = _device(owner, "desk gpu")
    browser = logged_in(owner)

    blank = browser.post(f"/devices/{device.pk}/rename", {"name": " "}, follow=True)
    control = browser.post(f"/devices/{device.pk}/rename", {"name": "bad\x00name"}, follow=True)
    unchanged = Device.objects.get(pk=device.pk).name
    renamed = browser.post(f"/devices/{device.pk}/rename", {"name": "  big   rig "}, follow=True)

    assert b"was not renamed: the device name is empty" in blank.content
    assert b"was not renamed" in control.content
    assert unchanged == "desk gpu"
    assert b"Renamed desk gpu to big rig" in renamed.content
    assert Device.objects.get(pk=device.pk).name == "big rig"


@pytest.mark.django_db
def test_renaming_and_revoking_need_post(owner: AbstractBaseUser) -> None:
    device = _device(owner, "desk gpu")
    browser = logged_in(owner)

    assert browser.get(f"/devices/{device.pk}/revoke").status_code == 405
    assert browser.get(f"/devices/{device.pk}/rename").status_code == 405
    assert not Device.objects.get(pk=device.pk).is_revoked


@pytest.mark.django_db
def test_an_agent_token_cannot_open_web_pages_as_its_volunteer(owner: AbstractBaseUser) -> None:
    device, token = _device_through_login(owner)
    agent = Client(headers={"Authorization": f"Bearer {token}"})

    page = agent.get("/devices/")
    revoke = agent.post(f"/devices/{device.pk}/revoke")
    verify = agent.get("/device")

    for response in (page, revoke, verify):
        assert response.status_code == 302 and "next=" in response["Location"]
    assert not Device.objects.get(pk=device.pk).is_revoked


@pytest.mark.django_db(transaction=True)
async def test_a_web_session_cannot_act_as_an_agent(owner: AbstractBaseUser) -> None:
    browser = await sync_to_async(logged_in)(owner)
    cookie = f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}"

    socket = WebsocketCommunicator(application, "/ws/agent/", headers=[(b"cookie", cookie.encode())])
    await socket.connect()
    closed = await socket.receive_output(timeout=5)
    me = await sync_to_async(browser.get)("/api/me")
    logout = await sync_to_async(browser.post)("/api/device/revoke")

    assert closed == {"type": "websocket.close", "code": CloseCode.UNAUTHORIZED}
    assert me.status_code == 401 and logout.status_code == 401
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_revoking_on_the_page_disconnects_the_running_agent_with_4003(
    owner: AbstractBaseUser,
    connect: Connect,  # noqa: F811
) -> None:
    device, token = await sync_to_async(_device_through_login)(owner)
    socket, connected, _ = await connect("/ws/agent/", token)
    await send(socket, HELLO)
    welcome = await receive(socket)
    browser = await sync_to_async(logged_in)(owner)

    page = await sync_to_async(browser.post)(f"/devices/{device.pk}/revoke", follow=True)
    closed = await socket.receive_output(timeout=5)
    again, _, _ = await connect("/ws/agent/", token)
    refused = await again.receive_output(timeout=5)
    me = await sync_to_async(Client().get)("/api/me", headers={"Authorization": f"Bearer {token}"})

    assert connected and isinstance(welcome, Welcome) and welcome.device_name == "lab-box"
    assert b"its agent was disconnected" in page.content
    assert closed == {"type": "websocket.close", "code": CloseCode.REVOKED}
    assert refused == {"type": "websocket.close", "code": CloseCode.REVOKED}
    assert me.status_code == 401


@pytest.mark.django_db(transaction=True)
async def test_hello_keeps_the_host_and_os_reported_at_login(
    owner: AbstractBaseUser,
    connect: Connect,  # noqa: F811
) -> None:
    device, token = await sync_to_async(_device_through_login)(owner)
    await sync_to_async(Device.objects.filter(pk=device.pk).update)(hardware={"os": "Linux 6.8", "hostname": "lab-box"})
    socket, _, _ = await connect("/ws/agent/", token)

    await send(socket, HELLO)
    await receive(socket)

    hardware = (await sync_to_async(Device.objects.get)(pk=device.pk)).hardware
    assert hardware["os"] == "Linux 6.8" and hardware["name"] == "test cpu"


@pytest.mark.django_db
def test_anonymous_visitors_are_sent_to_log_in(client: Client) -> None:
    response = client.get("/devices/")

    assert response.status_code == 302 and "next=/devices/" in response["Location"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("address", "network"), [("8.8.4.77", "8.8.4.0/24"), ("127.0.0.1", None)])
async def test_hello_notes_the_public_network_a_device_connects_from(
    owner: AbstractBaseUser, address: str, network: str | None
) -> None:
    # Copies go to volunteers on other networks first (verification.affinity); an address says nothing
    # of who is behind it when it is loopback or private, so none is noted then.
    from tests.web.gateway.conftest import offered_subprotocols

    device, token = await sync_to_async(_device_through_login)(owner)
    socket = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {token}".encode())],
        subprotocols=offered_subprotocols(),
    )  # fmt: skip
    socket.scope["client"] = (address, 50000)
    assert (await socket.connect())[0]
    try:
        await send(socket, HELLO)
        await receive(socket)
    finally:
        await socket.disconnect()

    hardware = (await sync_to_async(Device.objects.get)(pk=device.pk)).hardware
    assert hardware.get("network") == network and hardware["name"] == "test cpu"


@pytest.mark.django_db(transaction=True)
async def test_an_agent_its_volunteer_paused_shows_paused_and_why(
    owner: AbstractBaseUser,
    connect: Connect,  # noqa: F811
) -> None:
    from crowdtrain.devices.activity import decode_activity, describe
    from crowdtrain.scheduler.hotstate import presence
    from crowdtrain_agent.protocol import Paused

    device, token = await sync_to_async(_device_through_login)(owner)
    socket, _, _ = await connect("/ws/agent/", token)
    await send(socket, HELLO)
    await receive(socket)

    await send(socket, Paused(why="outside your schedule"))
    for _ in range(100):
        found = decode_activity(presence.newest(device.pk))
        if found is not None and found.kind == "paused":
            break
        await asyncio.sleep(0.02)

    assert found is not None and describe(found, {}, found.at)["text"] == "paused: outside your schedule"


def test_every_text_input_of_the_device_pages_says_its_type_so_the_site_styles_it() -> None:
    # Issue 34: small unstyled "Name it" inputs (the site's CSS styles inputs by type).
    import re

    from crowdtrain_launcher import REPO_ROOT

    for name in ("confirm.html", "verify.html", "list.html"):
        html = (REPO_ROOT / "frontend" / "templates" / "devices" / name).read_text()
        untyped = [tag for tag in re.findall(r"<input\b[^>]*>", html, re.S) if "type=" not in tag]
        assert not untyped, (name, untyped)


@pytest.mark.django_db
def test_a_volunteer_sets_a_devices_controls_and_bad_ones_are_refused_by_name(owner: AbstractBaseUser) -> None:
    # Issue 34: the controls on My devices, sent to the agent with the device's settings.
    device = _device(owner, "desk gpu")
    client = logged_in(owner)
    url = f"/devices/{device.pk}/controls"

    saved = client.post(url, {"idle_minutes": "5", "schedule": "mon-fri  18:00-08:00", "pause_on_battery": "on",
                              "upload_kbps": "", "download_kbps": "20000"}, follow=True)  # fmt: skip
    refused = client.post(url, {"schedule": "weekends"}, follow=True)
    other = Client()
    other.force_login(make_user("mallory"))

    device.refresh_from_db()
    assert device.controls == {"idle_minutes": 5.0, "schedule": "mon-fri 18:00-08:00", "pause_on_battery": True,
                               "download_kbps": 20000.0}  # fmt: skip
    assert "Saved the controls of desk gpu" in saved.content.decode()
    assert "were not changed: schedule part &#x27;weekends&#x27;" in refused.content.decode()
    assert other.post(url, {"idle_minutes": "1"}).status_code == 404, "nobody else's device"
    page = client.get("/devices/").content.decode()
    assert 'value="mon-fri 18:00-08:00"' in page and 'name="pause_on_battery" checked' in page


@pytest.mark.django_db(transaction=True)
async def test_the_welcome_carries_the_devices_controls(
    owner: AbstractBaseUser,
    connect: Connect,  # noqa: F811
) -> None:
    device, token = await sync_to_async(_device_through_login)(owner)
    await sync_to_async(Device.objects.filter(pk=device.pk).update)(controls={"schedule": "sat,sun 00:00-24:00"})
    socket, _, _ = await connect("/ws/agent/", token)

    await send(socket, HELLO)
    welcome = await receive(socket)

    assert isinstance(welcome, Welcome) and welcome.controls is not None
    assert welcome.controls.schedule == "sat,sun 00:00-24:00" and welcome.controls.idle_minutes is None


@pytest.mark.django_db(transaction=True)
async def test_controls_saved_on_my_devices_reach_the_connected_agent_at_once(
    owner: AbstractBaseUser,
    connect: Connect,  # noqa: F811
) -> None:
    # Issue 34: a volunteer who sets a schedule while her agent runs should not have to restart it.
    device, token = await sync_to_async(_device_through_login)(owner)
    socket, _, _ = await connect("/ws/agent/", token)
    await send(socket, HELLO)
    welcome = await receive(socket)
    assert isinstance(welcome, Welcome) and welcome.controls is None

    client = await sync_to_async(logged_in)(owner)
    url = f"/devices/{device.pk}/controls"
    await sync_to_async(client.post)(url, {"schedule": "sat,sun 00:00-24:00", "upload_kbps": "512"})
    pushed = await receive(socket)
    await sync_to_async(client.post)(url, {"schedule": "weekends"})  # refused: nothing is pushed
    await sync_to_async(client.post)(url, {})  # every control cleared
    cleared = await receive(socket)

    assert isinstance(pushed, ControlsChanged) and pushed.controls is not None
    assert pushed.controls.schedule == "sat,sun 00:00-24:00" and pushed.controls.upload_kbps == 512.0
    assert isinstance(cleared, ControlsChanged) and cleared.controls is None


@pytest.mark.django_db(transaction=True)
async def test_an_agent_older_than_2_9_is_not_sent_controls_it_cannot_read(owner: AbstractBaseUser) -> None:
    from crowdtrain_agent.protocol import encode_message
    from crowdtrain_agent.protocol.subprotocols import subprotocol

    device, token = await sync_to_async(_device_through_login)(owner)
    old = WebsocketCommunicator(application, "/ws/agent/", headers=[(b"authorization", f"Bearer {token}".encode())],
                                subprotocols=[subprotocol(8)])  # fmt: skip
    assert (await old.connect())[0]
    await old.send_to(text_data=encode_message(HELLO, 8))
    await old.receive_from(timeout=5)  # the welcome
    client = await sync_to_async(logged_in)(owner)
    await sync_to_async(client.post)(f"/devices/{device.pk}/controls", {"schedule": "sat,sun 00:00-24:00"})

    assert await old.receive_nothing(timeout=0.5), "a 2.8 agent takes its controls with its next welcome"
    await old.disconnect()


@pytest.mark.django_db
def test_threads_and_gpu_memory_are_controls_too_and_only_whole_threads_are_taken(owner: AbstractBaseUser) -> None:
    from crowdtrain.devices.actions import device_controls
    from crowdtrain_agent.protocol import encode_message

    device = _device(owner, "desk gpu")
    client = logged_in(owner)
    url = f"/devices/{device.pk}/controls"

    refused = client.post(url, {"threads": "2.5"}, follow=True).content.decode()
    client.post(url, {"threads": "6", "gpu_memory_gb": "7.5"})
    device.refresh_from_db()
    controls = device_controls(device)
    welcome = Welcome(device_id=1, device_name="d", volunteer="v", heartbeat_s=25, gone_after_s=90, controls=controls)

    assert "threads must be a number from 1 to 1024 (a whole number of CPU threads)" in refused
    assert device.controls == {"threads": 6, "gpu_memory_gb": 7.5}
    assert controls is not None and controls.threads == 6 and controls.gpu_memory_gb == 7.5
    assert '"threads":6' in encode_message(welcome) and "threads" not in encode_message(welcome, 8), "2.9 fields"

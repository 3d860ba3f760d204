"""`crowdtrain-agent login`, `whoami` and `logout` against a live site, approved in the browser meanwhile."""

from __future__ import annotations

import json
import stat
import time
import urllib.request
import webbrowser
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client, override_settings
from django.utils import timezone

from crowdtrain.accounts.models import Device, DeviceAuthorization
from crowdtrain_agent import cli, login
from crowdtrain_agent.config import read_config_file, write_config_file
from tests.factories import make_volunteer

pytestmark = pytest.mark.django_db(transaction=True)

HARDWARE = {"hostname": "test-box", "os": "Linux test", "cpu_count": 2}


@pytest.fixture(autouse=True)
def quick_site(settings: Any) -> Iterator[None]:
    """Poll every second, and a fresh cache so rate limits never carry over from other tests."""
    settings.CROWDTRAIN_DEVICE_CODE_INTERVAL_S = 1
    with override_settings(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                               "LOCATION": "agent-login-tests"}}):  # fmt: skip
        yield


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "agent" / "config.json"
    monkeypatch.setenv("CROWDTRAIN_AGENT_CONFIG", str(path))
    return path


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Pages the agent opened; a desktop session so it tries, and GPU probing skipped to keep tests fast."""
    pages: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, new=0: pages.append(url) or True)
    monkeypatch.setattr(login, "collect_hardware", lambda **_: dict(HARDWARE))
    monkeypatch.setenv("DISPLAY", ":0")
    for name in ("SSH_CONNECTION", "SSH_TTY", "CROWDTRAIN_AGENT_SERVER"):
        monkeypatch.delenv(name, raising=False)
    return pages


@pytest.fixture
def owner() -> AbstractBaseUser:
    return make_volunteer("owner")


def _start_login(*args: str) -> tuple[ThreadPoolExecutor, Future[int]]:
    pool = ThreadPoolExecutor(max_workers=1)
    return pool, pool.submit(cli.main, ["login", *args])


def _wait_for_code(timeout_s: float = 20) -> DeviceAuthorization:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        authorization = DeviceAuthorization.objects.first()
        if authorization is not None:
            return authorization
        time.sleep(0.05)
    raise AssertionError("the agent never asked for a device code")


def _decide(user: AbstractBaseUser, authorization: DeviceAuthorization, decision: str, name: str = "") -> None:
    browser = Client()
    browser.force_login(user)
    response = browser.post(
        "/device/confirm",
        {"user_code": authorization.user_code, "decision": decision, "name": name or authorization.requested_name},
    )
    assert response.status_code == 200, response.content


def _me(server: str, token: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{server}/api/me", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_login_saves_a_private_token_that_works(
    live_server: Any, config_file: Path, opened: list[str], owner: AbstractBaseUser, capsys: pytest.CaptureFixture[str]
) -> None:
    pool, result = _start_login("--server", live_server.url, "--name", "lab-gpu")
    authorization = _wait_for_code()

    _decide(owner, authorization, "approve", name="lab gpu 3")
    code = result.result(timeout=30)
    pool.shutdown()

    out = capsys.readouterr().out
    saved = read_config_file(config_file)
    assert code == 0
    assert authorization.requested_name == "lab-gpu" and authorization.hardware == HARDWARE
    user_code = f"{authorization.user_code[:4]}-{authorization.user_code[4:]}"
    assert user_code in out and f"{live_server.url}/device" in out
    assert opened == [f"{live_server.url}/device?user_code={user_code}"]
    assert "Logged in to" in out and "as owner@example.org" in out and "'lab gpu 3'" in out
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o600
    assert saved["server"] == live_server.url
    assert _me(live_server.url, saved["token"])["device_name"] == "lab gpu 3"
    assert Device.objects.get().owner == owner


def test_a_denied_login_says_so_saves_nothing_and_exits_non_zero(
    live_server: Any, config_file: Path, opened: list[str], owner: AbstractBaseUser, capsys: pytest.CaptureFixture[str]
) -> None:
    pool, result = _start_login("--server", live_server.url, "--no-browser")
    authorization = _wait_for_code()

    _decide(owner, authorization, "deny")
    code = result.result(timeout=30)
    pool.shutdown()

    assert code == cli.EXIT_STOPPED
    assert "login denied" in capsys.readouterr().err
    assert opened == []  # --no-browser
    assert not config_file.exists() and not Device.objects.exists()


def test_an_expired_login_says_to_start_again_and_exits_non_zero(
    live_server: Any, config_file: Path, opened: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pool, result = _start_login("--server", live_server.url)
    _wait_for_code()

    DeviceAuthorization.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    code = result.result(timeout=30)
    pool.shutdown()

    err = capsys.readouterr().err
    assert code == cli.EXIT_STOPPED
    assert "login expired" in err and f"crowdtrain-agent login --server {live_server.url}" in err
    assert not config_file.exists()


def test_polling_honours_slow_down_by_waiting_five_seconds_longer(
    live_server: Any, opened: list[str], owner: AbstractBaseUser
) -> None:
    code = login.request_code(live_server.url, "fast poller", HARDWARE)
    authorization = DeviceAuthorization.objects.get()
    waits: list[float] = []

    def no_wait(seconds: float) -> None:  # polls back to back, so the site answers slow_down
        waits.append(seconds)
        if len(waits) == 3:
            _decide(owner, authorization, "approve")

    issued = login.poll_for_token(live_server.url, code, sleep=no_wait)

    assert waits == [1, 1, 6]
    assert DeviceAuthorization.objects.get().interval == 6
    assert issued.identity.user == "owner@example.org" and issued.identity.device_name == "fast poller"


def test_whoami_prints_the_account_device_and_site(
    live_server: Any, config_file: Path, owner: AbstractBaseUser, capsys: pytest.CaptureFixture[str]
) -> None:
    device, token = Device.issue(owner, "desk gpu")
    write_config_file(config_file, server=live_server.url, token=token)

    code = cli.main(["whoami"])

    out = capsys.readouterr().out
    assert code == 0
    assert "user:   owner" in out and f"desk gpu (#{device.pk})" in out and live_server.url in out


def test_whoami_explains_a_revoked_token_and_a_missing_login(
    live_server: Any, config_file: Path, owner: AbstractBaseUser, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = cli.main(["whoami"])
    missing_err = capsys.readouterr().err
    device, token = Device.issue(owner, "desk gpu")
    Device.objects.filter(pk=device.pk).update(revoked_at=timezone.now())
    write_config_file(config_file, server=live_server.url, token=token)

    revoked = cli.main(["whoami"])

    revoked_err = capsys.readouterr().err
    assert missing == revoked == cli.EXIT_STOPPED
    assert "not logged in" in missing_err and "crowdtrain-agent login" in missing_err
    assert "does not accept this device's token" in revoked_err
    assert f"crowdtrain-agent login --server {live_server.url}" in revoked_err


def test_logout_revokes_the_token_on_the_site_and_deletes_it_here(
    live_server: Any, config_file: Path, owner: AbstractBaseUser, capsys: pytest.CaptureFixture[str]
) -> None:
    device, token = Device.issue(owner, "desk gpu")
    write_config_file(config_file, server=live_server.url, token=token)

    code = cli.main(["logout"])

    assert code == 0
    assert "the site revoked this device's token" in capsys.readouterr().out
    assert Device.objects.get(pk=device.pk).is_revoked
    assert read_config_file(config_file) == {"server": live_server.url}
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o600


def test_logout_without_the_site_still_deletes_the_token_and_says_the_site_was_not_told(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_config_file(config_file, server="http://127.0.0.1:9", token="ctd_unreachable")

    code = cli.main(["logout"])

    out, err = capsys.readouterr()
    assert code == 0
    assert "cannot reach" in err and "The site was not told" in err and "http://127.0.0.1:9/devices/" in err
    assert "the token was deleted" in out
    assert "token" not in read_config_file(config_file)


def test_text_from_the_site_cannot_drive_the_terminal() -> None:
    assert login.printable("\x1b[2J\x1b]0;pwned\x07WDJB-MJHT\n") == "[2J]0;pwnedWDJB-MJHT"


def test_hardware_is_reported_without_importing_anything_slow() -> None:
    hardware = login.collect_hardware(probe_torch=False)

    assert {"hostname", "os", "cpu_count", "python", "agent_version"} <= hardware.keys()
    assert len(json.dumps(hardware)) < 4096

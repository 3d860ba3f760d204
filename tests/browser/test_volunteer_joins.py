"""A newcomer signs up, verifies, names herself, founds a team and logs an agent in with a device code, in Chromium."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import Page, expect
from websockets.sync.client import connect

from crowdtrain.accounts.models import Device
from crowdtrain_agent.protocol import (
    PROTOCOL_VERSION,
    AgentHello,
    DeviceInfo,
    Heartbeat,
    Welcome,
    decode_message,
    encode_message,
)
from crowdtrain_launcher import REPO_ROOT
from tests.browser.live_site import LiveSite, Outbox, Shot
from tests.factories import make_volunteer

PASSWORD = "correct horse battery staple"
# What `crowdtrain-agent login` prints: the verification address alone, then the code (device_grant's alphabet).
VERIFICATION_URI = re.compile(r"(https?://[^\s│|]+/device)(?=[\s│|])")
PREFILLED_LINK = re.compile(r"(https?://\S+/device\?user_code=[A-Z-]+)")
USER_CODE = re.compile(r"\b([BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4})\b")
# The site asks agents to poll every 5 s (CROWDTRAIN_DEVICE_CODE_INTERVAL_S): an approved login lands within two polls.
AGENT_EXIT_S = 20.0
AGENT_PRINTS_CODE_S = 20.0  # Python start-up, and up to 3 s asking torch about the GPU, on two busy cores


class AgentCommand:
    """One ``crowdtrain-agent`` subprocess whose stdout and stderr are read as they come, so a test can wait on them."""

    def __init__(self, args: list[str], config: Path) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("CROWDTRAIN_AGENT_")}
        env["CROWDTRAIN_AGENT_CONFIG"] = str(config)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "agent" / "src"), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"  # the code must reach us while the agent waits, not when it exits
        env["PYTHONIOENCODING"] = "utf-8"  # rich draws its panel with box characters
        env["COLUMNS"] = "200"  # rich wraps at 80 columns without a terminal: keep the address on one line
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, "-m", "crowdtrain_agent.cli", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            encoding="utf-8", errors="replace",
        )  # fmt: skip
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self._stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, self._stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line)  # list.append is atomic: the test thread may read meanwhile

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def describe(self) -> str:
        status = "still running" if self.process.poll() is None else f"exit code {self.process.returncode}"
        return (
            f"`crowdtrain-agent {' '.join(self.args)}` ({status}) printed\n"
            f"--- stdout ---\n{self.stdout or '(nothing)'}\n--- stderr ---\n{self.stderr or '(nothing)'}"
        )

    def wait_for(self, pattern: re.Pattern[str], what: str, timeout_s: float) -> re.Match[str]:
        """The first match of ``pattern`` in stdout, waiting up to ``timeout_s``; fails with the output so far."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = pattern.search(self.stdout)
            if found:
                return found
            if self.process.poll() is not None and not any(reader.is_alive() for reader in self._readers):
                pytest.fail(f"the agent exited before printing {what}; {self.describe()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the agent printed no {what} within {timeout_s:.0f} s; {self.describe()}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> int:
        """Wait for the exit and the last output; fails with the output so far if it takes too long."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not exit within {timeout_s:.0f} s; {self.describe()}")
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def agents() -> Iterator[list[AgentCommand]]:
    """Agent subprocesses a test starts; any still running are killed after it."""
    started: list[AgentCommand] = []
    yield started
    for agent in started:
        agent.stop()


def start_login(agents: list[AgentCommand], server: str, name: str, config: Path) -> AgentCommand:
    agent = AgentCommand(["login", "--server", server, "--no-browser", "--name", name], config)
    agents.append(agent)
    return agent


def log_in(page: Page, email: str, password: str) -> None:
    """Fill in and send the log-in form the page shows."""
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password:", exact=True).fill(password)
    page.get_by_role("button", name="Sign In").click()
    expect(page.get_by_role("button", name="Log out")).to_be_visible()


def test_a_newcomer_signs_up_founds_a_team_and_logs_her_agent_in(
    page: Page, shot: Shot, live_site: LiveSite, outbox: Outbox, agents: list[AgentCommand], tmp_path: Path
) -> None:
    config = tmp_path / "agent" / "config.json"
    device_name = "grace-workstation"

    # Sign up with e-mail and password.
    page.goto("/")
    page.get_by_role("link", name="Sign up").click()
    page.get_by_label("Email").fill("grace@example.org")
    page.get_by_label("Password:", exact=True).fill(PASSWORD)
    page.get_by_label("Password (again)").fill(PASSWORD)
    shot(page, "sign-up page")
    page.get_by_role("button", name="Sign Up").click()
    expect(page.get_by_role("heading", name="Verify Your Email Address")).to_be_visible()

    # Confirm the address through the link in the mail.
    mail = outbox.newest(to="grace@example.org")
    confirm_links = [link for link in mail.links if "/accounts/confirm-email/" in link]
    assert confirm_links, f"no confirmation link in {mail.subject!r}: {mail.body}"
    assert confirm_links[0].startswith(f"{live_site.url}/"), confirm_links[0]
    page.goto(confirm_links[0])
    expect(page.get_by_role("heading", name="Confirm Email Address")).to_be_visible()
    expect(page.get_by_role("main")).to_contain_text("Please confirm that grace@example.org is an email address")
    shot(page, "confirm e-mail")
    page.get_by_role("button", name="Confirm").click()

    # Confirmed in the browser she signed up in, she is logged in and back where she started (the home page).
    expect(page.get_by_role("status").first).to_contain_text("You have confirmed grace@example.org")
    expect(page.get_by_role("button", name="Log out")).to_be_visible()
    expect(page).to_have_url(f"{live_site.url}/")
    expect(page.get_by_role("link", name="My devices")).to_be_visible()
    shot(page, "logged-in home")

    # A display name, then a team of her own with her in it.
    page.get_by_role("link", name="Profile").click()
    page.get_by_label("Display name").fill("Grace Hopper")
    page.get_by_role("button", name="Save profile").click()
    expect(page.get_by_test_id("public-name")).to_have_text("Grace Hopper")
    page.get_by_role("link", name="Team", exact=True).click()
    page.get_by_role("link", name="Create a team").click()
    page.get_by_label("Name").fill("Compilers United")
    page.get_by_label("Description").fill("We turn English into machine code.")
    page.get_by_role("button", name="Create team").click()
    expect(page.get_by_role("heading", name="Compilers United", level=1)).to_be_visible()
    members = page.get_by_role("region", name="Members").get_by_role("listitem")
    expect(members).to_have_count(1)
    expect(members.first).to_contain_text("Grace Hopper")
    expect(members.first).to_contain_text("you")
    shot(page, "team page")

    # The agent asks for a device code; she types it in and approves the name it proposes.
    agent = start_login(agents, live_site.url, device_name, config)
    verification_uri = agent.wait_for(VERIFICATION_URI, "verification address", AGENT_PRINTS_CODE_S).group(1)
    user_code = agent.wait_for(USER_CODE, "user code", AGENT_PRINTS_CODE_S).group(1)
    assert verification_uri == f"{live_site.url}/device", agent.describe()
    page.goto(verification_uri)
    page.get_by_label("Device code").fill(user_code)
    page.get_by_role("button", name="Continue").click()
    expect(page.get_by_role("heading", name="Approve this device?")).to_be_visible()
    expect(page.get_by_text(user_code)).to_be_visible()
    expect(page.get_by_label("Name it")).to_have_value(device_name)
    shot(page, "approve this device")
    page.get_by_role("button", name="Approve").click()
    expect(page.get_by_role("heading", name="Device approved")).to_be_visible()
    expect(page.get_by_role("main")).to_contain_text(f"{device_name} is now yours")
    shot(page, "device approved")

    # The agent saves its token, readable by her only.
    exit_code = agent.finish(AGENT_EXIT_S)
    assert exit_code == 0, agent.describe()
    assert f"this machine is device {device_name!r}" in agent.stdout, agent.describe()
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    saved = json.loads(config.read_text())
    assert saved["server"] == live_site.url
    assert saved["token"]

    # The token opens the agent's WebSocket, and whoami names her and the device.
    username = get_user_model().objects.get(email="grace@example.org").get_username()
    device = Device.objects.get(owner__username=username)
    ws_url = live_site.url.replace("http://", "ws://", 1) + "/ws/agent/"
    hello = AgentHello(
        protocol_version=PROTOCOL_VERSION,
        agent_version="browser-test",
        device=DeviceInfo(kind="cpu", name="Test CPU", threads=1),
    )
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {saved['token']}"}, open_timeout=10) as ws:
        ws.send(encode_message(hello))
        welcome = decode_message(ws.recv(timeout=10))

        assert isinstance(welcome, Welcome), welcome
        assert (welcome.device_id, welcome.device_name, welcome.volunteer) == (
            device.pk,
            device_name,
            "grace@example.org",
        )
        whoami = AgentCommand(["whoami"], config)
        agents.append(whoami)
        assert whoami.finish(AGENT_EXIT_S) == 0, whoami.describe()
        assert "user:   grace@example.org" in whoami.stdout, whoami.describe()
        assert f"device: {device_name} (#{device.pk})" in whoami.stdout, whoami.describe()

        # While the agent is connected, "My devices" shows it online.
        ws.send(encode_message(Heartbeat()))
        page.get_by_role("link", name="My devices", exact=True).click()
        card = page.get_by_role("region", name=device_name)
        expect(card).to_be_visible()
        expect(card.get_by_text("online now")).to_be_visible()
        expect(card).to_contain_text(re.compile(r"Last seen\s*now"))  # online: seen now, not "0 minutes ago"
        shot(page, "my devices")


def test_a_code_nobody_asked_for_is_refused_with_a_clear_message(page: Page, shot: Shot) -> None:
    make_volunteer("linus", password=PASSWORD)
    page.goto("/accounts/login/")
    log_in(page, "linus@example.org", PASSWORD)

    page.goto("/device")
    page.get_by_label("Device code").fill("bcdf ghjk")
    page.get_by_role("button", name="Continue").click()

    expect(page.get_by_role("alert")).to_contain_text(
        "No device is waiting for code BCDF-GHJK. Check it against your terminal"
    )
    expect(page.get_by_label("Device code")).to_have_value("bcdf ghjk")
    shot(page, "unknown code")
    assert not Device.objects.exists()


def test_a_denied_login_stops_the_agent_with_a_message_and_saves_nothing(
    page: Page, shot: Shot, live_site: LiveSite, agents: list[AgentCommand], tmp_path: Path
) -> None:
    config = tmp_path / "agent" / "config.json"
    make_volunteer("linus", password=PASSWORD)
    page.goto("/accounts/login/")
    log_in(page, "linus@example.org", PASSWORD)
    agent = start_login(agents, live_site.url, "someone-elses-laptop", config)
    user_code = agent.wait_for(USER_CODE, "user code", AGENT_PRINTS_CODE_S).group(1)
    prefilled_link = agent.wait_for(PREFILLED_LINK, "link with the code filled in", AGENT_PRINTS_CODE_S).group(1)

    page.goto(prefilled_link)
    expect(page.get_by_label("Name it")).to_have_value("someone-elses-laptop")
    page.get_by_role("button", name="Deny").click()
    exit_code = agent.finish(AGENT_EXIT_S)

    expect(page.get_by_role("heading", name="Device denied")).to_be_visible()
    shot(page, "device denied")
    assert exit_code == 1, agent.describe()
    assert f"login denied: code {user_code} was denied in the browser" in agent.stderr, agent.describe()
    assert not config.exists()
    assert not Device.objects.exists()

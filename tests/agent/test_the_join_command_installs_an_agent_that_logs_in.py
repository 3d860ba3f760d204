"""A stranger's way in: the join page's pip command installs the site's agent wheel in a fresh venv; it logs in.

The fresh virtual environment gets the agent from the site's URL, and only the
agent: PyTorch and the other dependencies come from this project's environment
through a .pth file, so the test downloads nothing (a cold PyTorch is 750 MB).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from crowdtrain.accounts.models import Device, DeviceAuthorization
from crowdtrain_agent import __version__
from tests.factories import make_campaign, make_volunteer

pytestmark = pytest.mark.django_db(transaction=True)

# The Linux step of the join page that installs the agent (campaigns/join_views.py; the lines before it install
# PyTorch).
INSTALL = re.compile(r"~/crowdtrain-agent/bin/pip install (\S+?\.whl)</code>")
STEP_TIMEOUT_S = 60


def _run(*args: str | Path, env: dict[str, str]) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=STEP_TIMEOUT_S)
    assert done.returncode == 0, (
        f"`{' '.join(map(str, args))}` exited with {done.returncode}:\n{done.stdout}{done.stderr}"
    )
    return done.stdout


def _wait_for_code(login: subprocess.Popen[str], timeout_s: float = 30) -> DeviceAuthorization:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        authorization = DeviceAuthorization.objects.first()
        if authorization is not None:
            return authorization
        if login.poll() is not None:
            pytest.fail(f"the installed agent exited before asking for a code: {login.communicate()}")
        time.sleep(0.1)
    pytest.fail("the installed agent never asked for a device code")


def test_the_join_pages_command_installs_the_sites_wheel_and_the_agent_logs_in(
    live_server: Any, settings: Any, tmp_path: Path
) -> None:
    settings.CROWDTRAIN_AGENT_WHEEL_DIR = tmp_path / "wheels"
    settings.CROWDTRAIN_DEVICE_CODE_INTERVAL_S = 1
    call_command("build_agent_wheel")
    campaign = make_campaign()
    volunteer = make_volunteer("stranger")
    venv, config = tmp_path / "fresh-venv", tmp_path / "agent" / "config.json"
    # Nothing of this checkout may leak in: the agent must come from the wheel alone.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("CROWDTRAIN_AGENT_")}
    env |= {"CROWDTRAIN_AGENT_CONFIG": str(config), "PIP_DISABLE_PIP_VERSION_CHECK": "1", "COLUMNS": "200"}

    # The command a stranger copies from the join page names the site's wheel.
    with urllib.request.urlopen(f"{live_server.url}/campaigns/{campaign.pk}/join", timeout=10) as page:
        spec = INSTALL.search(page.read().decode())
    assert spec is not None, "no Linux install command on the join page"
    assert spec.group(1) == f"{live_server.url}/agent/crowdtrain_agent-{__version__}-py3-none-any.whl"

    # A fresh venv, the agent from that URL (its dependencies from ours: --no-deps, then a .pth).
    _run(sys.executable, "-m", "venv", venv, env=env)
    _run(venv / "bin" / "pip", "install", "--no-deps", "--no-index", spec.group(1), env=env)
    purelib = Path(
        _run(
            venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=env
        ).strip()
    )
    (purelib / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = _run(
        venv / "bin" / "python", "-c", "import crowdtrain_agent; print(crowdtrain_agent.__file__)", env=env
    )
    version = _run(venv / "bin" / "crowdtrain-agent", "--version", env=env)

    # It logs in with a device code, approved by its volunteer.
    login = subprocess.Popen(
        [venv / "bin" / "crowdtrain-agent", "login", "--server", live_server.url, "--no-browser", "--name", "fresh"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        authorization = _wait_for_code(login)
        browser = Client()
        browser.force_login(volunteer)
        browser.post("/device/confirm", {"user_code": authorization.user_code, "decision": "approve", "name": "fresh"})
        out, err = login.communicate(timeout=STEP_TIMEOUT_S)
    finally:
        login.kill()

    assert Path(installed.strip()).is_relative_to(purelib), installed
    assert version.strip() == f"crowdtrain-agent {__version__}"
    assert login.returncode == 0, out + err
    assert Device.objects.get().owner == volunteer
    assert json.loads(config.read_text())["server"] == live_server.url

"""/agent/<wheel> serves the agent wheel manage.py build_agent_wheel made, under its versioned name only."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from crowdtrain.campaigns.agent_wheel import wheel_name
from crowdtrain_agent import __version__


@pytest.fixture
def wheel_dir(tmp_path: Path, settings: Any) -> Path:
    settings.CROWDTRAIN_AGENT_WHEEL_DIR = tmp_path / "agent"
    return tmp_path / "agent"


def test_the_built_wheel_is_served_at_its_versioned_url(client: Client, wheel_dir: Path) -> None:
    call_command("build_agent_wheel")

    response = client.get(f"/agent/crowdtrain_agent-{__version__}-py3-none-any.whl")

    body = b"".join(response.streaming_content)  # type: ignore[attr-defined]
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    assert body == (wheel_dir / wheel_name()).read_bytes()
    with zipfile.ZipFile(wheel_dir / wheel_name()) as wheel:
        names = wheel.namelist()
        entry_points = wheel.read(f"crowdtrain_agent-{__version__}.dist-info/entry_points.txt").decode()
    assert "crowdtrain_agent/cli.py" in names and "crowdtrain_agent/protocol/__init__.py" in names
    assert "crowdtrain-agent = crowdtrain_agent.cli:console_main" in entry_points
    assert not [name for name in names if name.endswith(".pyc")]


def test_another_name_is_a_404_that_names_the_right_one(client: Client, wheel_dir: Path) -> None:
    response = client.get("/agent/crowdtrain_agent-0.0.1-py3-none-any.whl")

    assert response.status_code == 404
    assert wheel_name() in response.content.decode()


def test_an_unbuilt_wheel_is_a_503_that_says_what_to_run(client: Client, wheel_dir: Path) -> None:
    response = client.get(f"/agent/{wheel_name()}")

    assert response.status_code == 503
    assert "manage.py build_agent_wheel" in response.content.decode()

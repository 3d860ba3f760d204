"""The public join page: copy-paste commands for this site and campaign, for each operating system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from crowdtrain_agent import __version__
from tests.factories import make_campaign

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def built_wheel(settings: Any, tmp_path: Path) -> Path:
    """The site's agent wheel, as ``manage.py serve`` leaves it (its bytes do not matter to the page)."""
    settings.CROWDTRAIN_AGENT_WHEEL_DIR = tmp_path / "wheels"
    path = settings.CROWDTRAIN_AGENT_WHEEL_DIR / f"crowdtrain_agent-{__version__}-py3-none-any.whl"
    path.parent.mkdir()
    path.write_bytes(b"PK")
    return path


def test_it_shows_install_login_and_run_commands_for_this_site_and_campaign(client: Client) -> None:
    campaign = make_campaign()

    page = client.get(f"/campaigns/{campaign.pk}/join")

    html = page.content.decode()
    assert page.status_code == 200
    assert html.count(" login --server http://testserver") == 3  # Linux, macOS, Windows
    assert html.count(f"run --campaign {campaign.pk}") == 3
    wheel = f"http://testserver/agent/crowdtrain_agent-{__version__}-py3-none-any.whl<"
    assert html.count(f"pip install {wheel}") == 2 and f"pip.exe install {wheel}" in html
    assert f"serves crowdtrain-agent {__version__}," in html
    assert html.count('data-copy="cmd-') == 14  # Linux has two more: the CPU or the CUDA build of PyTorch


def test_linux_volunteers_choose_the_cpu_or_cuda_pytorch_knowing_its_size_and_headless_machines_can_log_in(
    client: Client,
) -> None:
    # Issue 34: pip pulled a multi-GB CUDA build with no word of its size; "opens your browser" on a server.
    campaign = make_campaign()

    html = client.get(f"/campaigns/{campaign.pk}/join").content.decode()

    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in html
    assert "the CPU build (about 200 MB)" in html and "CUDA build for an NVIDIA GPU (about 3 GB" in html
    assert "(opens your browser)" not in html and html.count("without one, open the link it prints on any device") >= 3


def test_it_is_public_but_only_for_published_campaigns(client: Client) -> None:
    draft = make_campaign()
    Campaign.objects.filter(pk=draft.pk).update(state=Campaign.State.DRAFT)

    assert client.get(f"/campaigns/{draft.pk}/join").status_code == 404
    assert client.get("/campaigns/999999/join").status_code == 404


def test_an_install_url_from_the_settings_is_quoted_for_each_shell(client: Client, settings: Any) -> None:
    settings.CROWDTRAIN_AGENT_PIP_SPEC = "crowdtrain-agent @ git+https://example.org/ct.git#subdirectory=agent"
    campaign = make_campaign()

    html = client.get(f"/campaigns/{campaign.pk}/join").content.decode()

    assert "pip install &#x27;crowdtrain-agent @ git+https://example.org/ct.git#subdirectory=agent&#x27;" in html
    assert "pip.exe install &#x27;crowdtrain-agent @ git+" in html
    assert "pip install ./agent" in html  # the fallback when that source is out of reach


def test_without_its_wheel_the_page_says_so_and_installs_from_the_source_instead(
    client: Client, built_wheel: Path
) -> None:
    # Issue 34: started without the wheel, the page linked it anyway, and pip met a 503.
    built_wheel.unlink()
    campaign = make_campaign()

    html = client.get(f"/campaigns/{campaign.pk}/join").content.decode()

    assert ".whl" not in html, "no link to a file the site does not have"
    assert html.count('data-testid="wheel-missing"') == 3
    assert "~/crowdtrain-agent/bin/pip install ./agent" in html


def test_manage_py_serve_builds_a_missing_wheel_before_serving(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built_wheel: Path
) -> None:
    from django.core.management import call_command

    from crowdtrain.lib import daphne_site

    built_wheel.unlink()
    served: list[list[str]] = []
    monkeypatch.setattr(daphne_site, "main", served.append)

    call_command("serve", "--port", "0")

    assert built_wheel.is_file() and built_wheel.stat().st_size > 10_000, "a real wheel, built from agent/"
    assert served and served[0][0] == "-b"

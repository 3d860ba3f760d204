"""The public "join this campaign" page (commands to install the agent, log it in and run it) and the agent's wheel."""

from __future__ import annotations

import logging
import re
import shlex
from dataclasses import dataclass

from django.conf import settings
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from crowdtrain.ops import campaign_monitor as monitor

from .agent_wheel import agent_version, wheel_name, wheel_path, wheel_ready, wheel_url
from .models import Campaign
from .visibility import can_watch

logger = logging.getLogger(__name__)

# PyTorch's own wheels, as pip downloads them for Linux x86-64 (torch 2.x): the CPU build from its CPU index, and
# the default CUDA build with the NVIDIA libraries it pulls in.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_CPU_MB = 200
TORCH_CUDA_GB = 3


@dataclass(frozen=True)
class Platform:
    key: str  # matched against the browser's platform to open the right section first
    title: str
    shell: str
    steps: list[tuple[str, str]]  # (what it does, command)
    from_source: str  # install from a checkout of the site's source, if pip cannot reach pip_spec


def _powershell_quote(text: str) -> str:
    # The same safe characters as shlex.quote; PowerShell escapes ' inside '...' by doubling it.
    return text if re.fullmatch(r"[\w@%+=:,./-]+", text) else "'" + text.replace("'", "''") + "'"


def _platforms(server: str, campaign_id: int, pip_spec: str, *, from_source: bool = False) -> list[Platform]:
    """Each platform's commands; ``from_source``: this site has no agent package to link, so the install step
    installs from a checkout of the source instead."""
    login = f"login --server {server}"
    run = f"run --campaign {campaign_id}"
    # On a machine without a browser (a server, over SSH) the agent prints a link and a code: any device will do.
    log_in = "Log this machine in (opens your browser; without one, open the link it prints on any device)"
    # A virtual environment keeps the agent's PyTorch apart from anything else on the machine,
    # and calling its programs by path needs no activation (PowerShell's policy often forbids it).
    from_source_posix = "~/crowdtrain-agent/bin/pip install ./agent"
    scripts = r"& $HOME\crowdtrain-agent\Scripts"
    from_source_windows = rf"{scripts}\pip.exe install .\agent"
    venv = ("Make a private Python environment for the agent", "python3 -m venv ~/crowdtrain-agent")
    install_posix = from_source_posix if from_source else f"~/crowdtrain-agent/bin/pip install {shlex.quote(pip_spec)}"
    install_windows = (
        from_source_windows if from_source else rf"{scripts}\pip.exe install {_powershell_quote(pip_spec)}"
    )
    rest = [
        ("Install the agent", install_posix),
        (log_in, f"~/crowdtrain-agent/bin/crowdtrain-agent {login}"),
        ("Start computing for this campaign", f"~/crowdtrain-agent/bin/crowdtrain-agent {run}"),
    ]
    # pip's default PyTorch on Linux is the CUDA build, some 3 GB with NVIDIA's libraries: a volunteer without
    # an NVIDIA GPU (or with a slow link) wants the CPU build, about 200 MB, installed first.
    linux = [
        venv,
        (
            f"Choose PyTorch: the CPU build (about {TORCH_CPU_MB} MB) for a machine without an NVIDIA GPU",
            f"~/crowdtrain-agent/bin/pip install torch --index-url {TORCH_CPU_INDEX}",
        ),
        (
            f"…or the CUDA build for an NVIDIA GPU (about {TORCH_CUDA_GB} GB with its libraries; pip's default)",
            "~/crowdtrain-agent/bin/pip install torch",
        ),
        *rest,
    ]
    posix = [venv, *rest]
    windows = [
        ("Make a private Python environment for the agent", r"py -m venv $HOME\crowdtrain-agent"),
        ("Install the agent", install_windows),
        (log_in, rf"{scripts}\crowdtrain-agent.exe {login}"),
        ("Start computing for this campaign", rf"{scripts}\crowdtrain-agent.exe {run}"),
    ]
    return [
        Platform("linux", "Linux", "bash", linux, from_source_posix),
        Platform("mac", "macOS", "Terminal (zsh or bash)", posix, from_source_posix),
        Platform("win", "Windows", "PowerShell", windows, from_source_windows),
    ]


@require_GET
def join(request: HttpRequest, campaign_id: int) -> HttpResponse:
    # Drafts are not public yet; finished campaigns keep their page, which says so.
    campaign = get_object_or_404(Campaign.objects.exclude(state=Campaign.State.DRAFT), pk=campaign_id)
    if not can_watch(request.user, campaign):  # invite-only: only for its volunteers
        raise Http404(f"no campaign {campaign_id}")
    server = request.build_absolute_uri("/").rstrip("/")
    # The site's own wheel unless the operator names another source: the agent this site speaks with.
    pip_spec = settings.CROWDTRAIN_AGENT_PIP_SPEC or wheel_url(request)
    context = {
        "campaign": campaign,
        "server": server,
        "platforms": _platforms(server, campaign.pk, pip_spec, from_source=not wheel_ready()),
        "pip_spec": pip_spec,
        "own_wheel": not settings.CROWDTRAIN_AGENT_PIP_SPEC,
        # A link that would answer 503 is not shown as the way in: the page says so and gives the alternative.
        "wheel_missing": not wheel_ready(),
        "agent_version": agent_version(),
        "finished": campaign.state == Campaign.State.FINISHED,
        # What the campaign costs a volunteer's link, measured by the agents already in it.
        "network": monitor.network(campaign),
    }
    return render(request, "campaigns/join.html", context)


@require_GET
def agent_wheel(request: HttpRequest, filename: str) -> HttpResponseBase:
    """The wheel, at a URL that names its version (pip reads name and version from it)."""
    if filename != wheel_name():
        return HttpResponse(
            f"This site serves {wheel_name()} only; its join pages show the command that installs it.\n",
            status=404,
            content_type="text/plain; charset=utf-8",
        )
    path = wheel_path()
    if not path.is_file():
        logger.warning("agent wheel %s requested but missing: run manage.py build_agent_wheel", path)
        return HttpResponse(
            f"The agent wheel is not built on this site yet. Its operator runs `manage.py build_agent_wheel` "
            f"(make serve does), which writes {path.name} to CROWDTRAIN_AGENT_WHEEL_DIR. Meanwhile, install the "
            "agent from a checkout of the Crowdtrain source: pip install ./agent\n",
            status=503,
            content_type="text/plain; charset=utf-8",
        )
    # A wheel is a zip archive. no-cache: pip caches downloads by URL, and a rebuilt agent of the same
    # version (a checkout between releases) must not be answered from a volunteer's cache.
    return FileResponse(
        path.open("rb"),
        as_attachment=True,
        filename=path.name,
        content_type="application/zip",
        headers={"Cache-Control": "no-cache"},
    )

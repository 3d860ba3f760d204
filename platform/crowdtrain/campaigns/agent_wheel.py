"""The agent wheel this site serves: built from ``agent/`` by ``manage.py build_agent_wheel``, downloaded by pip.

A volunteer's ``pip install <site>/agent/crowdtrain_agent-<version>-py3-none-any.whl``
gets exactly the agent the site speaks with, whether or not it is on PyPI.
The wheel is a build output (never committed): ``make serve``, ``make demo``,
``make cluster`` and the Docker image build it; a site without it answers 503
with what its operator should run.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest
from django.urls import reverse

import crowdtrain_agent

logger = logging.getLogger(__name__)

AGENT_SOURCE = Path(__file__).resolve().parents[3] / "agent"
# Left behind by editable installs and earlier builds; copying them would put stale files in the wheel.
_NOT_SOURCE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.pyc")
BUILD_TIMEOUT_S = 300


class WheelBuildError(RuntimeError):
    """``pip wheel`` failed or made another file than expected; the message carries pip's output."""


def agent_version() -> str:
    """The agent version this site ships; the same module ``crowdtrain-agent --version`` prints."""
    return crowdtrain_agent.__version__


def wheel_name(version: str | None = None) -> str:
    return f"crowdtrain_agent-{version or agent_version()}-py3-none-any.whl"


def wheel_path() -> Path:
    return Path(settings.CROWDTRAIN_AGENT_WHEEL_DIR) / wheel_name()


def wheel_url(request: HttpRequest) -> str:
    """The absolute URL of the wheel, as a stranger's pip reaches this site."""
    return request.build_absolute_uri(reverse("agent-wheel", args=[wheel_name()]))


def build_wheel(into: Path, source: Path = AGENT_SOURCE) -> Path:
    """Build the agent's wheel from ``source`` into ``into`` and return its path.

    The source is copied first: pip builds in the tree it is given, and the
    checkout may be read-only (the Docker image) or hold an editable install's
    leftovers. No build isolation, so nothing is downloaded: the setuptools of
    the site's own environment builds it. The file appears under its final
    name only when complete, so a site serving it never sends half a wheel.

    Raises:
        WheelBuildError: if pip fails, or the wheel's version is not ``crowdtrain_agent.__version__``
            (agent/pyproject.toml and agent/src/crowdtrain_agent/__init__.py disagree).
    """
    into.mkdir(parents=True, exist_ok=True)
    expected = wheel_name()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-agent-wheel-") as scratch:
        copy = Path(scratch) / "agent"
        shutil.copytree(source, copy, ignore=_NOT_SOURCE)
        out = Path(scratch) / "out"
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        command += ["--disable-pip-version-check", "--quiet", "--wheel-dir", str(out), str(copy)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise WheelBuildError(
                f"`{' '.join(command)}` exited with {done.returncode}:\n{done.stdout}{done.stderr}"
                "the site's environment needs setuptools>=68 (pip install setuptools)"
            )
        built = sorted(path.name for path in out.glob("*.whl"))
        if built != [expected]:
            raise WheelBuildError(
                f"pip built {built or 'nothing'}, expected {expected}: make the version in agent/pyproject.toml "
                f"and crowdtrain_agent.__version__ ({agent_version()}) the same"
            )
        partial = into / f".{expected}.partial"
        shutil.copyfile(out / expected, partial)
        partial.replace(into / expected)
    logger.info("agent wheel %s built in %s", expected, into)
    return into / expected


def wheel_ready() -> bool:
    """Whether this site has the wheel its join pages link (an operator's CROWDTRAIN_AGENT_PIP_SPEC needs none)."""
    return bool(settings.CROWDTRAIN_AGENT_PIP_SPEC) or wheel_path().is_file()


def ensure_wheel() -> Path | None:
    """Build the wheel the join pages link if it is missing (``manage.py serve`` at start); its path, or None when
    the operator names another source.

    Raises:
        WheelBuildError: if it cannot be built (the join pages then say so and show the alternative).
    """
    if settings.CROWDTRAIN_AGENT_PIP_SPEC:
        return None
    path = wheel_path()
    if path.is_file():
        return path
    if not (AGENT_SOURCE / "pyproject.toml").is_file():
        raise WheelBuildError(f"the agent's source is not at {AGENT_SOURCE}: build the wheel where it is")
    return build_wheel(path.parent)

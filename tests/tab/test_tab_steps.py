"""The tab worker's protocol steps, each under Node with a fake network (tests/tab/steps.test.mjs).

The steps are plain functions and small classes (frontend/src/tab/control.js, params.js, upload.js,
compute.js) so that what a tab says, waits for and refuses is checked without a browser; the
Chromium tests check the whole worker's gradients (tests/browser/test_tab_gradients.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = REPO / "tests" / "tab" / "steps.test.mjs"


def test_the_tabs_protocol_steps_pass_under_node() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: the tab's modules are tested under Node 20 (apt-get install nodejs npm)")
    if not (REPO / "frontend" / "node_modules" / "fzstd").is_dir():
        pytest.fail("frontend/node_modules is missing: run `make charts` (npm ci in frontend/) first")

    done = subprocess.run([node, "--test", str(STEPS)], capture_output=True, text=True, timeout=120, cwd=REPO)

    assert done.returncode == 0, f"node --test {STEPS.name} failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert "# fail 0" in done.stdout and "# pass 0" not in done.stdout

"""The browser-compute modules import, and export a graph, in a process with no Django settings at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import json, sys
from crowdtrain.browser.gate import check_browser_compute
import crowdtrain.browser.report
from django.conf import settings
_, result = check_browser_compute("mlp", {"in_dim": 4, "hidden": [4], "classes": 2}, 2)
print(json.dumps({"configured": settings.configured, "passed": result.passed}))
"""


def test_a_graph_is_exported_and_gated_without_django_settings(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("platform", "agent/src"))

    # From an empty folder: the repository root holds a folder named platform.
    done = subprocess.run([sys.executable, "-c", CODE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '{"configured": false, "passed": true}'

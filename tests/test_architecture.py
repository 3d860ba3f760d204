"""The house rules on who imports whom, each checked in a fresh interpreter (docs/contributing.md, "Where code goes").

Each case imports modules in a child process and reads ``sys.modules`` there: this
test process has imported everything already, so only a fresh one can tell what an
import pulls in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]

# Imports every module of the named packages (their __main__ too: each guards its entry point),
# then prints the top-level names in sys.modules.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
for name in sys.argv[1:]:
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(module.name)
print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules})))
"""


def top_level_modules_after_importing(*packages: str, walk: bool = True, tmp_path: Path) -> set[str]:
    code = IMPORT_ALL if walk else (
        "import importlib, json, sys\n"
        "for name in sys.argv[1:]: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))\n"
    )  # fmt: skip
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "PYTHONPATH": os.pathsep.join([str(ROOT / p) for p in ("platform", "agent/src", "deploy/launcher")]),
    }
    # Run from an empty folder: the repository root holds a folder named platform.
    result = subprocess.run(
        [sys.executable, "-c", code, *packages], check=False, cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_the_protocol_pulls_in_neither_torch_nor_django(tmp_path: Path) -> None:
    loaded = top_level_modules_after_importing("crowdtrain_agent.protocol", walk=False, tmp_path=tmp_path)

    assert not loaded & {"torch", "django", "numpy"}, sorted(loaded & {"torch", "django", "numpy"})


def test_the_protocol_needs_only_the_standard_library_and_msgspec(tmp_path: Path) -> None:
    loaded = top_level_modules_after_importing("crowdtrain_agent.protocol", walk=False, tmp_path=tmp_path)
    msgspec_itself = top_level_modules_after_importing("msgspec", walk=False, tmp_path=tmp_path)

    allowed = {"crowdtrain_agent"} | msgspec_itself  # msgspec and what it imports (typing_extensions)
    third_party = {m for m in loaded if m not in sys.stdlib_module_names and not m.startswith("_")}

    # Everyone imports the protocol, volunteers' machines included: each dependency is one more for all.
    assert third_party <= allowed, sorted(third_party - allowed)


def test_the_aggregator_never_imports_django(tmp_path: Path) -> None:
    loaded = top_level_modules_after_importing("crowdtrain_backbone", tmp_path=tmp_path)

    assert "torch" in loaded  # the walk reached the node, so every module was imported
    assert "django" not in loaded and "crowdtrain" not in loaded, sorted(loaded & {"django", "crowdtrain"})


def test_the_agent_never_imports_the_site_the_aggregator_or_django(tmp_path: Path) -> None:
    loaded = top_level_modules_after_importing("crowdtrain_agent", tmp_path=tmp_path)

    forbidden = {"crowdtrain", "crowdtrain_backbone", "crowdtrain_launcher", "django"}
    assert "torch" in loaded  # the walk reached the trainer, so every module was imported
    assert not loaded & forbidden, sorted(loaded & forbidden)


def test_the_launcher_never_imports_django(tmp_path: Path) -> None:
    loaded = top_level_modules_after_importing("crowdtrain_launcher", tmp_path=tmp_path)

    # It starts sites before any settings exist (benchmarks, make cluster, tests/services.py).
    assert "django" not in loaded


def test_the_sites_distribution_leaves_the_launcher_out() -> None:
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(where=str(ROOT / found["where"][0]), include=found["include"])
    launcher = tomllib.loads((ROOT / "deploy" / "launcher" / "pyproject.toml").read_text())

    assert {"crowdtrain", "crowdtrain_backbone"} <= set(shipped)
    # It runs the programs from a checkout and starts engines: a production image has no use for it.
    assert not [name for name in shipped if name.startswith("crowdtrain_launcher")], shipped
    assert launcher["project"]["name"] == "crowdtrain-launcher"

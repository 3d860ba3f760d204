"""Each patch on a library's internals holds only for the version it was measured on: an upgrade is a decision.

The internals are looked up in a child interpreter: importing daphne's server
installs twisted's asyncio reactor, which the test process must not get.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from crowdtrain.lib.patches import PATCHES, Internal, Patch
from crowdtrain_launcher import PYTHONPATH

ROOT = Path(__file__).resolve().parents[1]

# Prints, for each path given, {"found": bool, "signature": str | None}.
LOOK_UP = """
import importlib, inspect, json, re, sys

def look_up(path):
    module_name, _, dotted = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        # An attribute the class sets on its instances: found by its assignment in the class's source.
        assigned = inspect.isclass(obj) and re.search(rf"self\\.{re.escape(part)}\\s*=", inspect.getsource(obj))
        return {"found": bool(assigned), "signature": None}
    try:
        signature = str(inspect.signature(obj)) if callable(obj) else None
    except (TypeError, ValueError):
        signature = None
    return {"found": True, "signature": signature}

print(json.dumps({path: look_up(path) for path in sys.argv[1:]}))
"""


def _label(patch: Patch) -> str:
    return patch.name


@pytest.fixture(scope="module")
def looked_up() -> dict[str, dict[str, object]]:
    paths = sorted({internal.path for patch in PATCHES for internal in patch.touches})
    env = {"PYTHONPATH": ":".join(str(p) for p in PYTHONPATH), "DJANGO_SETTINGS_MODULE": "crowdtrain.settings"}
    done = subprocess.run(
        [sys.executable, "-c", LOOK_UP, *paths], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("patch", PATCHES, ids=_label)
def test_each_patched_library_is_the_version_its_patch_was_measured_for(patch: Patch) -> None:
    installed = metadata.version(patch.library)

    assert installed == patch.written_for, (
        f"{patch.library} is now {installed}, but the patch {patch.name!r} was written for {patch.written_for}. "
        f"Check that {patch.library} still needs it ({patch.why}); re-measure its gain ({patch.gain}) with "
        f"{patch.shown_by}; then set written_for to {installed} in crowdtrain/lib/patches.py, or remove the patch."
    )


@pytest.mark.parametrize(
    ("patch", "internal"),
    [(patch, internal) for patch in PATCHES for internal in patch.touches],
    ids=[f"{patch.name}:{internal.path}" for patch in PATCHES for internal in patch.touches],
)
def test_each_internal_a_patch_touches_is_still_there_in_the_shape_it_expects(
    patch: Patch, internal: Internal, looked_up: dict[str, dict[str, object]]
) -> None:
    seen = looked_up[internal.path]

    assert seen["found"], (
        f"{internal.path} is gone from {patch.library} {metadata.version(patch.library)}: the patch {patch.name!r} "
        f"({patch.where or 'crowdtrain.lib.patches'}) depends on it; rewrite or remove the patch"
    )
    if internal.signature is not None:
        assert seen["signature"] == internal.signature, (
            f"{internal.path} now takes {seen['signature']}, where the patch {patch.name!r} expects "
            f"{internal.signature}; check {patch.where or 'crowdtrain.lib.patches'} against the new code"
        )


@pytest.mark.parametrize("patch", PATCHES, ids=_label)
def test_each_patch_names_a_test_or_bench_line_that_exists(patch: Patch) -> None:
    tests = re.findall(r"tests/[\w/]+\.py", patch.shown_by)
    bench_lines = re.findall(r"bench: ([\w, ]+)", patch.shown_by)

    assert tests or bench_lines, f"{patch.name}: shown_by names neither a test nor a bench line"
    assert all((ROOT / test).is_file() for test in tests), f"{patch.name}: {tests}"
    assert bool(patch.apply) != bool(patch.where), f"{patch.name}: either applied in place or subclassed at `where`"

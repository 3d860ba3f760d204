"""Where no network namespace can be made (not root), every home-link line says skipped, with the reason."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.benchmarks import homelink
from tests.benchmarks.homelink_figures import figure_names


def _unshare_refused(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    if argv[0] != "unshare":
        raise AssertionError(f"only unshare should run when it fails, not {argv}")
    return subprocess.CompletedProcess(argv, 1, "", "unshare: unshare failed: Operation not permitted\n")


def test_every_line_says_skipped_with_unshares_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(homelink.shutil, "which", lambda tool: f"/usr/bin/{tool}")

    code = homelink.outside([], run=_unshare_refused)

    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split("=", 1)[0] for line in lines] == [f"bench: {name}" for name in figure_names()]
    said = "=skipped (no network namespace: `unshare --net` said: unshare: unshare failed: Operation not permitted"
    assert all(said in line for line in lines)


def test_a_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(homelink.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")

    homelink.outside([], run=_unshare_refused)

    out = capsys.readouterr().out
    assert "bench: home_link_efficiency_local_int8=skipped (tc is not installed" in out
    assert "Operation not permitted" not in out

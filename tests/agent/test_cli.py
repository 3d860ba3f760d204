"""The command line: version, help, and configuration errors."""

from __future__ import annotations

import pytest

from crowdtrain_agent import __version__, cli


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])

    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"crowdtrain-agent {__version__}"


def test_run_help_lists_flags_and_environment_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])

    out = capsys.readouterr().out
    flags = ("--server", "--token", "--device", "--threads", "--campaign", "--cache-dir", "--max-leases")
    flags += ("--no-progress",)
    assert all(flag in out for flag in flags)
    assert "CROWDTRAIN_AGENT_TOKEN" in out


def test_a_bad_environment_value_stops_start_up_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CROWDTRAIN_AGENT_THREADS", "0")

    code = cli.main(["run", "--token", "t", "--no-progress"])

    assert code == cli.EXIT_CONFIG
    assert "CROWDTRAIN_AGENT_THREADS must be a positive integer, got '0'" in capsys.readouterr().err


def test_without_a_token_it_says_where_to_put_one(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run", "--server", "http://127.0.0.1:9", "--no-progress"])

    assert code == cli.EXIT_CONFIG
    assert "pass --token TOKEN or set CROWDTRAIN_AGENT_TOKEN" in capsys.readouterr().err

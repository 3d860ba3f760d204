"""Configuration: flags beat environment beat the saved login beat defaults; bad values stop start-up."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from crowdtrain_agent.config import ConfigError, load_config, read_config_file, write_config_file


def test_flags_beat_environment_beat_config_file(tmp_path: Path) -> None:
    saved = tmp_path / "config.json"
    write_config_file(saved, server="http://file.example:8000", token="file-token")
    env = {
        "CROWDTRAIN_AGENT_SERVER": "http://env.example",
        "CROWDTRAIN_AGENT_THREADS": "3",
        "CROWDTRAIN_AGENT_CAMPAIGN": "9",
    }

    from_flags = load_config({"server": "https://flag.example/", "token": "flag-token", "threads": "5"}, env, saved)
    from_env = load_config({}, {**env, "CROWDTRAIN_AGENT_TOKEN": "env-token"}, saved)
    from_file = load_config({}, {}, saved)

    assert (from_flags.server, from_flags.token, from_flags.threads) == ("https://flag.example", "flag-token", 5)
    assert from_flags.campaign_id == 9
    assert from_flags.control_url == "wss://flag.example/ws/agent/"
    assert (from_env.server, from_env.token, from_env.threads) == ("http://env.example", "env-token", 3)
    assert (from_file.server, from_file.token) == ("http://file.example:8000", "file-token")
    assert (from_file.device, from_file.threads) == ("auto", None)


def test_saved_token_is_never_sent_to_another_server(tmp_path: Path) -> None:
    saved = tmp_path / "config.json"
    write_config_file(saved, server="http://file.example:8000", token="file-token")

    with pytest.raises(ConfigError, match="no API token for http://other.example"):
        load_config({"server": "http://other.example"}, {}, saved)


def test_bad_environment_value_names_variable_value_and_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as threads:
        load_config({"token": "t"}, {"CROWDTRAIN_AGENT_THREADS": "lots"}, tmp_path / "none.json")
    with pytest.raises(ConfigError) as device:
        load_config({"token": "t"}, {"CROWDTRAIN_AGENT_DEVICE": "tpu"}, tmp_path / "none.json")
    with pytest.raises(ConfigError) as server:
        load_config({"token": "t"}, {"CROWDTRAIN_AGENT_SERVER": "ftp://x"}, tmp_path / "none.json")

    assert str(threads.value) == "CROWDTRAIN_AGENT_THREADS must be a positive integer, got 'lots'"
    assert "CROWDTRAIN_AGENT_DEVICE must be one of auto, cpu, cuda, mps, got 'tpu'" in str(device.value)
    assert "CROWDTRAIN_AGENT_SERVER" in str(server.value) and "'ftp://x'" in str(server.value)


def test_config_file_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "config.json"

    write_config_file(path, server="http://127.0.0.1:8000/", token="secret")

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_config_file(path) == {"server": "http://127.0.0.1:8000", "token": "secret"}


def test_a_damaged_config_file_says_how_to_fix_it(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")

    with pytest.raises(ConfigError, match="delete it and log in again"):
        read_config_file(path)

"""The aggregator's config: flags beat environment beat defaults, and bad values stop startup clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from crowdtrain_backbone.config import DEFAULT_MAX_PENDING_BYTES, ConfigError, load_config


def test_flags_beat_environment_beat_defaults() -> None:
    environ = {"CROWDTRAIN_BACKBONE_TOKEN": "env-token", "CROWDTRAIN_BACKBONE_PORT": "9001",
               "CROWDTRAIN_BACKBONE_NAME": "agg-env"}  # fmt: skip

    config = load_config({"port": "0", "checkpoint_dir": "ck", "site": None}, environ)

    assert config.port == 0 and config.token == "env-token" and config.name == "agg-env"
    assert config.checkpoint_dir == Path("ck") and config.site == "http://127.0.0.1:8000"
    assert config.max_pending_bytes == DEFAULT_MAX_PENDING_BYTES
    assert config.public_host == "127.0.0.1" and config.torch_threads == 1
    assert config.header_timeout_s == 5.0
    assert config.backbone_ws_url == "ws://127.0.0.1:8000/ws/backbone/"


def test_an_https_site_is_reached_over_wss() -> None:
    config = load_config({"token": "t", "site": "https://crowdtrain.example.org/"}, {})

    assert config.backbone_ws_url == "wss://crowdtrain.example.org/ws/backbone/"


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ({}, {}, "CROWDTRAIN_BACKBONE_TOKEN"),
        ({"token": "t"}, {"CROWDTRAIN_BACKBONE_PORT": "http"}, "CROWDTRAIN_BACKBONE_PORT='http' is not a TCP port"),
        ({"token": "t", "port": "70000"}, {}, "--port='70000'"),
        ({"token": "t"}, {"CROWDTRAIN_BACKBONE_SITE": "localhost:8000"}, "is not a site URL"),
        ({"token": "t"}, {"CROWDTRAIN_BACKBONE_MAX_PENDING_BYTES": "-1"}, "must be a positive number of bytes"),
        ({"token": "t", "name": "two words"}, {}, "--name='two words'"),
        ({"token": "t"}, {"CROWDTRAIN_BACKBONE_TORCH_THREADS": "0"}, "must be a number of threads from 1 to 256"),
        ({"token": "t", "torch_threads": "many"}, {}, "--torch-threads='many'"),
        ({"token": "t"}, {"CROWDTRAIN_BACKBONE_HEADER_TIMEOUT_S": "0"}, "must be a positive number of seconds"),
        ({"token": "t", "header_timeout_s": "soon"}, {}, "--header-timeout-s='soon'"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(
    flags: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(flags, environ)

    assert message in str(error.value)


def test_a_checkpoint_url_must_name_a_bucket_and_empty_means_the_folder() -> None:
    base = {"CROWDTRAIN_BACKBONE_TOKEN": "t"}
    assert load_config({}, {**base, "CROWDTRAIN_BACKBONE_CHECKPOINT_URL": ""}).checkpoint_url == ""
    url = load_config({"checkpoint_url": "s3://bucket/ckpt"}, base).checkpoint_url
    assert url == "s3://bucket/ckpt"
    with pytest.raises(ConfigError, match="--checkpoint-url='/var/ckpt' must be an S3 location like s3://BUCKET"):
        load_config({"checkpoint_url": "/var/ckpt"}, base)


def test_a_fallback_folder_comes_with_a_bucket_not_with_a_folder_and_empty_means_none() -> None:
    base = {"CROWDTRAIN_BACKBONE_TOKEN": "t"}
    bucket = {"checkpoint_url": "s3://bucket/ckpt"}

    with_bucket = load_config(bucket, base).checkpoint_fallback_dir
    with_folder = load_config({}, base).checkpoint_fallback_dir
    chosen = load_config({**bucket, "checkpoint_fallback_dir": "/srv/keep"}, base).checkpoint_fallback_dir
    refused = load_config(bucket, {**base, "CROWDTRAIN_BACKBONE_CHECKPOINT_FALLBACK_DIR": ""}).checkpoint_fallback_dir

    assert (with_bucket, with_folder) == (Path("var/checkpoints-fallback"), None)
    assert (chosen, refused) == (Path("/srv/keep"), None)


@pytest.mark.parametrize("variable", ["CROWDTRAIN_BACKBONE_TOKEN", "CROWDTRAIN_BACKBONE_METRICS_TOKEN"])
def test_a_bad_token_is_named_but_not_repeated(variable: str) -> None:
    # Start-up errors reach logs; a token with a space in it is still somebody's token.
    environ = {"CROWDTRAIN_BACKBONE_TOKEN": "fine-token", variable: "half of a token"}

    with pytest.raises(ConfigError) as info:
        load_config({}, environ)

    assert variable in str(info.value) and "<hidden>" in str(info.value)
    assert "half of a token" not in str(info.value)

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from crowdtrain.env import env_bool, env_hex_bytes, env_int


def test_typed_readers_fall_back_to_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CT_TEST_VALUE", raising=False)

    assert env_int("CT_TEST_VALUE", 3) == 3
    assert env_hex_bytes("CT_TEST_VALUE", b"k") == b"k"


@pytest.mark.parametrize(
    ("reader", "raw", "problem"),
    [
        (lambda: env_int("CT_TEST_VALUE", 1, minimum=2), "1", "at least 2, got '1'"),
        (lambda: env_int("CT_TEST_VALUE", 1), "ten", "must be an integer, got 'ten'"),
        (lambda: env_bool("CT_TEST_VALUE", True), "maybe", "must be true or false"),
        (lambda: env_hex_bytes("CT_TEST_VALUE", b""), "not-hex", "must be hexadecimal"),
        (lambda: env_hex_bytes("CT_TEST_VALUE", b""), "abcd", "at least 16 bytes"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_accepted(
    monkeypatch: pytest.MonkeyPatch, reader: object, raw: str, problem: str
) -> None:
    monkeypatch.setenv("CT_TEST_VALUE", raw)

    with pytest.raises(ImproperlyConfigured, match=problem) as info:
        reader()  # type: ignore[operator]

    assert "CT_TEST_VALUE" in str(info.value)


@pytest.mark.parametrize("raw", ["0123456789abcdef", "secret-but-not-hex"])
def test_a_bad_key_is_named_but_its_value_is_not_shown(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # A key too short or malformed is still a secret: start-up errors end up in logs.
    monkeypatch.setenv("CT_TEST_VALUE", raw)

    with pytest.raises(ImproperlyConfigured) as info:
        env_hex_bytes("CT_TEST_VALUE", b"")

    assert "CT_TEST_VALUE" in str(info.value) and "<hidden>" in str(info.value)
    assert raw not in str(info.value)

"""The connection-try header: what a client writes parses back, and nothing else a client sends breaks the site."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent.protocol import ConnectionTries, ConnectionTry, parse_connection_try

instances = st.text(alphabet="0123456789abcdef", min_size=8, max_size=32)
numbers = st.integers(min_value=0, max_value=10**15 - 1)


@given(instances, numbers)
def test_a_written_try_parses_back_to_itself(instance: str, number: int) -> None:
    attempt = ConnectionTry(instance, number)
    assert parse_connection_try(attempt.header()) == attempt


@given(st.one_of(st.none(), st.text(max_size=80)))
def test_any_header_value_parses_to_nothing_or_to_a_try_that_writes_back_the_same(value: str | None) -> None:
    attempt = parse_connection_try(value)
    if attempt is not None:
        assert parse_connection_try(attempt.header()) == attempt
        assert 8 <= len(attempt.instance) <= 32 and 0 <= attempt.number < 10**15


def test_malformed_values_are_no_try() -> None:
    hex16 = "0123456789abcdef"
    bad = ["", "abc/1", "ABCDEF0123/1", hex16, f"{hex16}/", f"{hex16}/-1", f"{hex16}/1.5", f"{hex16}/١٢",
           f"{hex16}/1234567890123456", "g123456789/1"]  # fmt: skip
    assert [parse_connection_try(value) for value in bad] == [None] * len(bad)


def test_tries_count_up_within_a_client_and_only_there() -> None:
    one, other = ConnectionTries(), ConnectionTries()
    first, second, elsewhere = one.next(), one.next(), other.next()
    assert first.instance == second.instance != elsewhere.instance
    assert (first.number, second.number, elsewhere.number) == (1, 2, 1)

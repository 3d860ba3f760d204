"""A server reads a client's subprotocol offer before any token: every offer is either chosen from or refused by name.

Before, ``choose_subprotocol`` took ``str.isdigit`` for ASCII digits, so a
superscript "³" or 5,000 nines reached ``int()`` and the site answered 500,
and "crowdtrain.2.04" was answered with "crowdtrain.2.4", which the client
never offered.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crowdtrain_agent.protocol import (
    PROTOCOL_MINOR,
    SubprotocolError,
    bearer_subprotocol,
    choose_subprotocol,
    close_reason,
    negotiated_minor,
    offered_bearer,
    offered_subprotocols,
    subprotocols_in_header,
)
from crowdtrain_agent.protocol.subprotocols import (
    MAX_BEARER_TOKEN_CHARS,
    MAX_OFFERED_SUBPROTOCOLS,
    MAX_SUBPROTOCOL_HEADER_CHARS,
)

ODD_OFFERS = {
    "a superscript digit": ["crowdtrain.2.³"],
    "5,000 nines": ["crowdtrain.2." + "9" * 5000],
    "a leading zero": ["crowdtrain.2.04"],
    "no minor": ["crowdtrain.2."],
    "a sign": ["crowdtrain.2.+4"],
    "a space inside": ["crowdtrain.2.4 5"],
    "a non-ASCII token": ["crowdträin"],
    "too many offers": [f"crowdtrain.2.{m}" for m in range(MAX_OFFERED_SUBPROTOCOLS + 1)],
    "an odd one after a good one": [f"crowdtrain.2.{PROTOCOL_MINOR}", "crowdtrain.2.٣"],
}


@pytest.mark.parametrize("offered", list(ODD_OFFERS.values()), ids=list(ODD_OFFERS))
def test_an_odd_offer_is_refused_with_a_reason_that_fits_a_close_frame(offered: list[str]) -> None:
    with pytest.raises(SubprotocolError) as refused:
        choose_subprotocol(offered)

    assert refused.value.close_code == 4004 and refused.value.fatal
    reason = str(refused.value)
    assert reason.isascii(), "it goes into an HTTP status line"
    assert len(close_reason(reason).encode()) <= 123


def test_the_pick_is_always_a_string_the_client_offered() -> None:
    assert choose_subprotocol(["crowdtrain.2.3", "crowdtrain.2.5", "chat"]) == ("crowdtrain.2.5", 5)
    assert choose_subprotocol(offered_subprotocols()) == (f"crowdtrain.2.{PROTOCOL_MINOR}", PROTOCOL_MINOR)
    # Another major, or a protocol not ours, is not picked and not refused: the client then speaks 2.0.
    assert choose_subprotocol(["crowdtrain.3.0", "graphql-ws"]) == (None, 0)


@given(st.lists(st.text(max_size=80), max_size=MAX_OFFERED_SUBPROTOCOLS + 4))
def test_any_offer_is_chosen_from_or_refused(offered: list[str]) -> None:
    try:
        chosen, minor = choose_subprotocol(offered)
    except SubprotocolError:
        return
    assert chosen is None or (chosen in offered and negotiated_minor(chosen) == minor <= PROTOCOL_MINOR)


@given(st.text(max_size=MAX_SUBPROTOCOL_HEADER_CHARS + 40))
def test_any_header_is_split_or_refused(header: str) -> None:
    try:
        items = subprotocols_in_header(header)
    except SubprotocolError:
        odd = not header.isascii() or not header.replace("\t", " ").isprintable() or "%" in header
        assert len(header) > MAX_SUBPROTOCOL_HEADER_CHARS or odd
        return
    assert all(item and item == item.strip() and "," not in item for item in items)


def test_a_header_of_3000_offers_or_a_raw_byte_is_refused_before_it_is_split() -> None:
    with pytest.raises(SubprotocolError, match="more than the"):
        subprotocols_in_header(", ".join(f"crowdtrain.2.{m}" for m in range(3000)))
    with pytest.raises(SubprotocolError, match="printable ASCII"):
        subprotocols_in_header(b"crowdtrain.2.\xb3".decode("latin-1"))
    assert subprotocols_in_header("crowdtrain.2.6, crowdtrain.2.5,,") == ["crowdtrain.2.6", "crowdtrain.2.5"]
    assert subprotocols_in_header("crowdtrain.2.6,\tcrowdtrain.2.5") == ["crowdtrain.2.6", "crowdtrain.2.5"]
    # daphne percent-decodes offers: "crowdtrain%2E2%2E7" would pass as a foreign token, then be picked decoded.
    with pytest.raises(SubprotocolError, match="percent sign"):
        subprotocols_in_header("crowdtrain%2E2%2E7")


@pytest.mark.parametrize("answer", ["crowdtrain.2.³", "crowdtrain.2.04", "crowdtrain.2." + "9" * 5000, "x"])
def test_a_client_takes_an_odd_answer_for_a_server_of_minor_0(answer: str) -> None:
    assert negotiated_minor(answer) == 0


def test_a_close_reason_is_cut_to_123_bytes_at_a_character() -> None:
    reason = close_reason("é" * 100)

    assert len(reason.encode()) <= 123 and reason.endswith("...")
    assert close_reason("short") == "short"


# ------------------------------------------------------------------ a browser tab's token (2.10)

TAB_TOKEN = "ctd_" + "A1b2-C3d4_" * 4 + "xyz"  # the shape of accounts.tokens.new_token("ctd"): 47 characters


def test_a_tabs_token_offer_is_read_and_never_picked() -> None:
    offered = [f"crowdtrain.2.{PROTOCOL_MINOR}", f"crowdtrain.2.{PROTOCOL_MINOR - 1}", bearer_subprotocol(TAB_TOKEN)]

    assert subprotocols_in_header(", ".join(offered)) == offered, "the header a browser sends is split back"
    assert choose_subprotocol(offered) == (f"crowdtrain.2.{PROTOCOL_MINOR}", PROTOCOL_MINOR)
    assert offered_bearer(offered) == TAB_TOKEN
    assert offered_bearer(offered_subprotocols()) is None
    # Alone, it is not a minor: the client speaks 2.0 then, and still shows its token.
    assert choose_subprotocol([bearer_subprotocol(TAB_TOKEN)]) == (None, 0)


ODD_BEARERS = {
    "no token": ["crowdtrain.bearer."],
    "an over-long token": ["crowdtrain.bearer." + "a" * (MAX_BEARER_TOKEN_CHARS + 1)],
    "a token of 5,000 characters": ["crowdtrain.bearer." + "a" * 5000],
    "a character no token has": ["crowdtrain.bearer.ctd_abc.def"],
    "a non-ASCII letter": ["crowdtrain.bearer.ctd_abcé"],
    "two tokens": [bearer_subprotocol(TAB_TOKEN), bearer_subprotocol(TAB_TOKEN + "x")],
}


@pytest.mark.parametrize("offered", list(ODD_BEARERS.values()), ids=list(ODD_BEARERS))
def test_an_odd_token_offer_is_refused_with_a_reason_that_never_quotes_it(offered: list[str]) -> None:
    for check in (choose_subprotocol, offered_bearer):
        with pytest.raises(SubprotocolError) as refused:
            check([f"crowdtrain.2.{PROTOCOL_MINOR}", *offered])

        reason = str(refused.value)
        assert refused.value.close_code == 4004 and refused.value.fatal
        assert "crowdtrain.bearer." in reason and "token" in reason, "it says which offer is wrong"
        assert reason.isascii() and len(close_reason(reason).encode()) <= 123
        for value in offered:
            secret = value.removeprefix("crowdtrain.bearer.")
            assert not secret or secret[:8] not in reason, "a token, right or wrong, never reaches a log"


def test_a_longest_token_offer_still_fits_the_header_bound() -> None:
    longest = [*offered_subprotocols(), bearer_subprotocol("a" * MAX_BEARER_TOKEN_CHARS)]

    assert len(", ".join(longest)) <= MAX_SUBPROTOCOL_HEADER_CHARS
    assert offered_bearer(subprotocols_in_header(", ".join(longest))) == "a" * MAX_BEARER_TOKEN_CHARS
    # Only the token offer may pass the bound on one subprotocol.
    with pytest.raises(SubprotocolError, match="more than the 64"):
        choose_subprotocol(["crowdtrain.other." + "a" * 60])

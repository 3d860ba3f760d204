"""The link check: rates a shaped link reaches pass, an unshaped or starved one is named."""

from __future__ import annotations

from tests.benchmarks.shaping import HomeLink, LinkRates, link_problem


def test_it_accepts_a_link_that_holds_its_rates() -> None:
    # Measured on this kernel through HTB at MTU 1500: payload is ~0.96 of the class's rate.
    assert link_problem(LinkRates(up_mbit=19.1, down_mbit=96.1), HomeLink()) is None


def test_it_names_a_link_that_is_not_shaped() -> None:
    problem = link_problem(LinkRates(up_mbit=9000.0, down_mbit=96.0), HomeLink())

    assert problem is not None
    assert "up 9000.0 Mbit/s for a 20 Mbit/s class" in problem
    assert "down" not in problem


def test_it_names_a_link_that_drops_packets() -> None:
    problem = link_problem(LinkRates(up_mbit=19.0, down_mbit=3.0), HomeLink())

    assert problem is not None
    assert "down 3.0 Mbit/s for a 100 Mbit/s class" in problem

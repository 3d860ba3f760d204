"""A newcomer whose result is disputed, or whose last ruling went against them, gets copies, not new work.

Seen in CI (stop 46): three hostile newcomers put 26 leases into the 40 steps of the trust run while their
disputes waited for a slow referee, and the validation loss ended 10% above the honest run's. Their harm
grew with the referee's delay; held from their first disagreement, it ends there.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.scheduler import leasing, reporting
from crowdtrain.verification import checks, referee, standing
from crowdtrain.verification.models import Check, Standing
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import NoLease, verify_ticket
from tests.factories import make_device, make_user
from tests.web.scheduler.test_probation import _trimmed
from tests.web.verification.test_checks import FLIPPED, HONEST, _done

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def leases_of_four(settings: Any) -> None:
    # Steps of 16 samples in leases of 4: a trimmed mean of 4 outvotes 1, so newcomers are on probation.
    settings.CROWDTRAIN_MAX_LEASE_SAMPLES = 4


@pytest.fixture(autouse=True)
def referee_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """The referee has not ruled yet (a busy site): disputes stay before it until a test calls ``decide``."""
    monkeypatch.setattr(referee, "call", lambda check_id: None)


def _campaign(**fields: Any) -> Campaign:
    """Probation's campaign (a trimmed mean of 4 leases a step), with every newcomer's lease checked."""
    return _trimmed(**{"check_fraction": 1.0, **fields})


def _ask(campaign: Campaign, device: Device) -> LeaseMessage | NoLease:
    return leasing.request_lease(device.pk, campaign.pk, None)


def _is_copy(campaign: Campaign, answer: LeaseMessage | NoLease) -> bool:
    return isinstance(answer, LeaseMessage) and verify_ticket(answer.ticket, ticket_key(campaign.pk)).check


def _report(campaign: Campaign, device: Device, lease: LeaseMessage | NoLease, sketch: list[float]) -> None:
    assert isinstance(lease, LeaseMessage), lease
    ack = reporting.report_done(device.pk, _done(campaign, lease, sketch)).ack
    assert ack.accepted, ack.reason


def _dispute(campaign: Campaign, original: Device, copier: Device, capture: Any) -> Check:
    """``original`` uploads a made-up gradient, ``copier`` an honest copy of it: a dispute before the referee."""
    with capture(execute=True):
        lease = _ask(campaign, original)
        assert not _is_copy(campaign, lease)
        _report(campaign, original, lease, FLIPPED)
        copy = _ask(campaign, copier)
        assert _is_copy(campaign, copy), copy
        _report(campaign, copier, copy, HONEST)
    case = Check.objects.get(lease_id=lease.lease_id)  # type: ignore[union-attr]
    assert case.state == Check.State.REFEREE and case.detail.startswith(standing.DISAGREEMENT), case.detail
    return case


def _held_why(answer: LeaseMessage | NoLease) -> str:
    assert isinstance(answer, NoLease), f"expected a refusal, got lease {answer.lease_id}"  # type: ignore[union-attr]
    assert answer.reason == "step_full", answer
    return answer.detail


def test_both_sides_of_a_dispute_wait_for_the_ruling_and_others_work_on(
    django_capture_on_commit_callbacks: Any,
) -> None:
    campaign = _campaign()
    mallory, _ = make_device("mallory")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")
    _dispute(campaign, mallory, bob, django_capture_on_commit_callbacks)

    # Who lied is the referee's to say: both newcomers wait, each told why and that nothing is theirs to do.
    for device in (mallory, bob):
        why = _held_why(_ask(campaign, device))
        assert "disagree" in why and "recomputing" in why and "resumes by itself" in why, why
    assert isinstance(_ask(campaign, carol), LeaseMessage), "a newcomer outside the dispute is not held"

    # Another site process, which did not see the dispute, reads the same from the database.
    standing.clear_caches()
    assert "recomputing" in _held_why(_ask(campaign, mallory))
    assert "recomputing" in _held_why(_ask(campaign, bob))


def test_a_held_newcomer_still_computes_copies_of_others_work(django_capture_on_commit_callbacks: Any) -> None:
    campaign = _campaign()
    mallory, _ = make_device("mallory")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")
    _dispute(campaign, mallory, bob, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        _report(campaign, carol, _ask(campaign, carol), HONEST)  # carol's lease is checked: a copy waits

    copy = _ask(campaign, bob)
    assert _is_copy(campaign, copy), "copies are what a held volunteer computes"
    _held_why(_ask(campaign, bob))


def test_the_ruling_frees_the_winner_and_holds_the_loser_until_a_check_of_theirs_passes(
    django_capture_on_commit_callbacks: Any,
) -> None:
    campaign = _campaign()
    mallory, _ = make_device("mallory")
    bob, _ = make_device("bob")
    case = _dispute(campaign, mallory, bob, django_capture_on_commit_callbacks)

    checks.decide(case.pk, HONEST)

    assert Check.objects.get(pk=case.pk).state == Check.State.FAILED
    assert isinstance(_ask(campaign, bob), LeaseMessage), "the ruling went for bob: he works again"
    why = _held_why(_ask(campaign, mallory))
    assert "disagreed with its own recomputation" in why and standing.STANDING_PATH in why, why
    # Read again by a process that holds nothing in memory: the same.
    standing.clear_caches()
    assert "recomputation" in _held_why(_ask(campaign, mallory))

    # A check of theirs that passes (a copy they computed, say) ends the hold.
    Standing.objects.filter(volunteer_id=mallory.owner_id).update(checks_passed=1, streak=1)
    standing.clear_caches()
    assert isinstance(_ask(campaign, mallory), LeaseMessage)


def test_proven_volunteers_organizers_and_campaigns_without_probation_are_never_held(
    django_capture_on_commit_callbacks: Any,
) -> None:
    campaign = _campaign()
    veteran, _ = make_device("veteran")
    Standing.objects.create(volunteer_id=veteran.owner_id, checks_passed=10, streak=10)
    mallory, _ = make_device("mallory")
    _dispute(campaign, mallory, veteran, django_capture_on_commit_callbacks)
    assert isinstance(_ask(campaign, veteran), LeaseMessage), "past probation: the referee will say"

    organizer = Device.issue(campaign.owner, "laptop")[0]
    trudy, _ = make_device("trudy")
    _dispute(campaign, organizer, trudy, django_capture_on_commit_callbacks)
    assert isinstance(_ask(campaign, organizer), LeaseMessage), "an organizer can harm only their own campaign"

    # A plain mean has no probation (nothing outvotes anyone): the hold, like the cap, does not apply.
    plain = _campaign(aggregation=Campaign.Aggregation.MEAN)
    assert isinstance(_ask(plain, mallory), LeaseMessage)


def test_an_agreeing_copy_by_a_like_volunteer_goes_to_the_referee_and_holds_nobody(
    django_capture_on_commit_callbacks: Any, clock: Any
) -> None:
    campaign = _campaign()
    alice, _ = make_device("alice")
    twin = Device.issue(make_user("twin", joined_hours_ago=24.0 * (1000 - 1) + 0.05), "laptop")[0]
    with django_capture_on_commit_callbacks(execute=True):
        lease = _ask(campaign, alice)
        _report(campaign, alice, lease, HONEST)
        clock.advance(settings.CROWDTRAIN_CHECK_SIMILAR_WAIT_S + 1)
        copy = _ask(campaign, twin)
        assert _is_copy(campaign, copy), copy
        _report(campaign, twin, copy, HONEST)
    case = Check.objects.get(lease_id=lease.lease_id)  # type: ignore[union-attr]
    assert case.state == Check.State.REFEREE and "like the original's" in case.detail, case.detail

    standing.clear_caches()
    assert isinstance(_ask(campaign, alice), LeaseMessage), "agreement proves little, but accuses nobody"
    assert isinstance(_ask(campaign, twin), LeaseMessage)

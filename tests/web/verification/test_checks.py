"""Verification by replication on the site's own paths: picking, copies for other volunteers, verdicts,
tie-breaks, credit held until a check passes, and quarantine after failed checks.

The aggregators' part (sketching what they received, signing it into the receipt) is
played here by signing receipts with a chosen sketch, exactly as an aggregator would.
"""

from __future__ import annotations

import asyncio
import json
import random
from datetime import timedelta
from typing import Any, cast

import msgspec
import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone
from kombu.exceptions import OperationalError

from crowdtrain.accounts.models import Device
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.credit.models import CreditEntry
from crowdtrain.scheduler import endings, leasing, parking, records, reporting
from crowdtrain.scheduler.configs import campaign_config
from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain.scheduler.models import Lease
from crowdtrain.verification import affinity, checks, quarantine, referee, standing, tasks
from crowdtrain.verification.models import Answer, Check, Standing
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import LeaseDone, NoLease, Receipt, sign_receipt, verify_ticket
from crowdtrain_agent.sketch import SKETCH_SIZE, to_bytes
from tests.factories import make_campaign, make_device, make_user, redo_samples

pytestmark = pytest.mark.django_db

HONEST = [random.Random(1).gauss(0.0, 1.0) for _ in range(SKETCH_SIZE)]
FLIPPED = [-4.0 * x for x in HONEST]
NOISE = [random.Random(2).gauss(0.0, 1.0) for _ in range(SKETCH_SIZE)]


def _done(campaign: Campaign, lease: LeaseMessage, sketch: list[float]) -> LeaseDone:
    """A report whose receipts carry ``sketch`` as an aggregator would sign it (one slice here)."""
    receipts = [
        Receipt(
            slice_index=route.index,
            token=sign_receipt(
                ticket_key(campaign.pk),
                campaign_id=campaign.pk,
                lease_id=lease.lease_id,
                slice_index=route.index,
                num_samples=lease.num_samples,
                sketch=to_bytes(sketch),
            ),
        )
        for route in lease.slices
    ]
    return LeaseDone(
        lease_id=lease.lease_id, receipts=receipts, num_samples=lease.num_samples, loss_sum=1.0, compute_s=0.1
    )


def _lease(campaign: Campaign, device_id: int) -> LeaseMessage:
    lease = leasing.request_lease(device_id, campaign.pk, None)
    assert isinstance(lease, LeaseMessage), lease
    return lease


def _work(campaign: Campaign, device_id: int, sketch: list[float]) -> tuple[LeaseMessage, str]:
    lease = _lease(campaign, device_id)
    ack = reporting.report_done(device_id, _done(campaign, lease, sketch)).ack
    assert ack.accepted, ack.reason
    return lease, ack.verification


def _a_verified_volunteers_lease_and_its_copy(campaign: Campaign) -> tuple[Device, Device, LeaseMessage, LeaseMessage]:
    """Bob's and Carol's devices, a lease of Alice's and its copy, handed to Bob.

    Alice was verified before: a first pass releases all of a volunteer's held credit, which would hide what
    these tests look at.
    """
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")
    Standing.objects.create(volunteer_id=alice.owner_id, checks_passed=5, streak=5)
    original, _ = _work(campaign, alice.pk, HONEST)
    return bob, carol, original, _lease(campaign, bob.pk)


async def _received(channel: str) -> dict[str, Any]:
    """The next message the channel layer holds for ``channel`` (a timeout if none comes)."""
    return cast(dict[str, Any], await asyncio.wait_for(get_channel_layer().receive(channel), 2.0))


def _granted(lease_id: int) -> int:
    return CreditEntry.objects.filter(lease_id=lease_id).aggregate(n=Sum("samples"))["n"] or 0


@pytest.fixture
def campaign() -> Campaign:
    # Every lease is checked (a newcomer's rate is four times the campaign's, at most all).
    return make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0)


def test_a_copy_goes_to_another_volunteer_and_an_agreeing_copy_releases_the_credit(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    alice, _ = make_device("alice")
    alice_tablet, _ = make_device("alice", "tablet")
    bob, _ = make_device("bob")

    original, verification = _work(campaign, alice.pk, HONEST)
    assert verification == "pending"
    case = Check.objects.get(lease_id=original.lease_id)
    assert case.state == Check.State.OPEN and case.volunteer_id == alice.owner_id

    # Alice's other device is never given her own lease to check.
    own = _lease(campaign, alice_tablet.pk)
    assert not verify_ticket(own.ticket, ticket_key(campaign.pk)).check
    copy = _lease(campaign, bob.pk)
    ticket = verify_ticket(copy.ticket, ticket_key(campaign.pk))
    assert ticket.check and ticket.lease_id == copy.lease_id != original.lease_id
    assert (copy.base_version, copy.ranges, copy.num_samples) == (
        original.base_version,
        original.ranges,
        original.num_samples,
    )

    with django_capture_on_commit_callbacks(execute=True):
        ack = reporting.report_done(bob.pk, _done(campaign, copy, [x * (1 + 1e-4) for x in HONEST])).ack
        assert (ack.accepted, ack.verification, ack.step) == (True, "check", None)
        while Campaign.objects.get(pk=campaign.pk).committed_steps < 1:
            _work(campaign, bob.pk, HONEST)
        checks.release_credit()

    case.refresh_from_db()
    assert case.state == Check.State.PASSED
    assert Standing.objects.get(volunteer_id=alice.owner_id).checks_passed == 1
    assert Standing.objects.get(volunteer_id=bob.owner_id).checks_passed == 1
    committed = Lease.objects.filter(pk=original.lease_id, step__isnull=False).exists()
    assert _granted(original.lease_id) == (original.num_samples if committed else 0)
    assert not Lease.objects.filter(pk=copy.lease_id).exists(), "a copy is never a lease of a step"
    assert _granted(copy.lease_id) == 0


def test_a_check_that_passes_after_its_step_was_committed_grants_the_withheld_credit_with_its_verdict(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    bob, carol, original, copy = _a_verified_volunteers_lease_and_its_copy(campaign)
    assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check
    while Campaign.objects.get(pk=campaign.pk).committed_steps < 1:
        _work(campaign, carol.pk, HONEST)
    assert Lease.objects.filter(pk=original.lease_id, step__isnull=False).exists()
    assert _granted(original.lease_id) == 0  # withheld by the open check

    with django_capture_on_commit_callbacks(execute=True):
        reporting.report_done(bob.pk, _done(campaign, copy, HONEST))

    case = Check.objects.get(lease_id=original.lease_id)
    assert (case.state, case.credited) == (Check.State.PASSED, True)
    assert _granted(original.lease_id) == original.num_samples


def test_a_disagreement_goes_to_the_referee_who_fails_the_made_up_original_and_passes_the_honest_copy(
    campaign: Campaign, django_capture_on_commit_callbacks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The referee's recomputation of the lease (a real one: tests/web/verification/test_referee.py).
    monkeypatch.setattr(referee, "recompute", lambda case: [x * (1 - 1e-4) for x in HONEST])
    mallory, _ = make_device("mallory")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")

    with django_capture_on_commit_callbacks(execute=True):
        original, _ = _work(campaign, mallory.pk, FLIPPED)
        copy = _lease(campaign, bob.pk)
        assert reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack.accepted
        # No third volunteer is asked: a vote among volunteers decides nothing.
        assert not verify_ticket(_lease(campaign, carol.pk).ticket, ticket_key(campaign.pk)).check
        checks.release_credit()

    case = Check.objects.get(lease_id=original.lease_id)
    assert case.state == Check.State.FAILED and case.detail.startswith("referee: original cosine -1.000")
    assert case.disputed_at is not None and case.refereed_at is not None
    verdicts = dict(Answer.objects.filter(case=case).values_list("volunteer_id", "verdict"))
    assert verdicts == {mallory.owner_id: Answer.Verdict.DISAGREED, bob.owner_id: Answer.Verdict.AGREED}
    rows = {row.volunteer_id: row for row in Standing.objects.all()}
    assert (rows[mallory.owner_id].rulings_lost, rows[mallory.owner_id].checks_failed) == (1, 1)
    assert (rows[bob.owner_id].rulings_won, rows[bob.owner_id].checks_passed) == (1, 1)
    assert _granted(original.lease_id) == 0
    assert checks.withheld([original.lease_id]) == {original.lease_id}


def test_the_referee_sides_with_a_lone_honest_volunteer_against_two_that_agree_on_a_made_up_gradient(
    campaign: Campaign, django_capture_on_commit_callbacks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 33's collusion: two accounts uploading the same made-up gradient outvoted the honest newcomer.
    monkeypatch.setattr(referee, "recompute", lambda case: HONEST)
    honest, _ = make_device("newcomer")
    mallory, _ = make_device("mallory")
    trudy, _ = make_device("trudy")
    with django_capture_on_commit_callbacks(execute=True):
        original, _ = _work(campaign, honest.pk, HONEST)
        for colluder in (mallory, trudy):  # both copy it; the second copy comes after the referee's ruling
            copy = leasing.request_lease(colluder.pk, campaign.pk, None)
            if isinstance(copy, LeaseMessage) and verify_ticket(copy.ticket, ticket_key(campaign.pk)).check:
                assert reporting.report_done(colluder.pk, _done(campaign, copy, FLIPPED)).ack.accepted

    case = Check.objects.get(lease_id=original.lease_id)
    assert case.state == Check.State.PASSED
    rows = {row.volunteer_id: row for row in Standing.objects.all()}
    assert rows[honest.owner_id].rulings_won == 1 and rows[honest.owner_id].checks_failed == 0
    assert rows[mallory.owner_id].rulings_lost == 1


def test_a_copy_by_a_volunteer_like_the_original_goes_to_the_referee_even_when_it_agrees(
    campaign: Campaign, django_capture_on_commit_callbacks, monkeypatch: pytest.MonkeyPatch, clock
) -> None:
    # Two accounts that joined minutes apart: their agreement is worth nothing; the referee finds it made up.
    monkeypatch.setattr(referee, "recompute", lambda case: HONEST)
    mallory, _ = make_device("mallory")
    trudy_user = make_user("trudy", joined_hours_ago=24.0 * (1000 - 1) + 0.05)  # three minutes after mallory
    trudy = Device.issue(trudy_user, "laptop")[0]
    assert affinity.similar(affinity.tags_of(mallory.owner_id, widen=True), affinity.tags_of(trudy.owner_id))
    with django_capture_on_commit_callbacks(execute=True):
        original, _ = _work(campaign, mallory.pk, FLIPPED)
        early = leasing.request_lease(trudy.pk, campaign.pk, None)
        assert not (isinstance(early, LeaseMessage) and verify_ticket(early.ticket, ticket_key(campaign.pk)).check)
        if isinstance(early, LeaseMessage):
            endings.release_lease(trudy.pk, early.lease_id)
        clock.advance(settings.CROWDTRAIN_CHECK_SIMILAR_WAIT_S + 1)
        copy = _lease(campaign, trudy.pk)
        assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check, "after the wait a similar volunteer may"
        assert reporting.report_done(trudy.pk, _done(campaign, copy, FLIPPED)).ack.accepted

    case = Check.objects.get(lease_id=original.lease_id)
    assert Answer.objects.get(lease_id=copy.lease_id).similar
    assert case.state == Check.State.FAILED and "like the original's" in case.detail
    assert Standing.objects.get(volunteer_id=trudy.owner_id).rulings_lost == 1


def test_a_decided_check_leaves_both_volunteers_new_records_in_this_process(
    campaign: Campaign, django_capture_on_commit_callbacks, django_assert_num_queries
) -> None:
    # Their next reports read the record (their check rate) without a query, and nobody's refusal is
    # read again: a check changes none.
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    copy = _lease(campaign, bob.pk)

    with django_capture_on_commit_callbacks(execute=True):
        assert reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack.accepted

    with django_assert_num_queries(0):
        records = [standing.record_of(device.owner_id) for device in (alice, bob)]
        refusals = [standing.refusal(device.owner_id) for device in (alice, bob)]
    assert records == [standing.Record(passed=1, streak=1)] * 2 and refusals == ["", ""]
    assert Check.objects.get(lease_id=original.lease_id).state == Check.State.PASSED


def test_a_dispute_the_referee_cannot_recompute_judges_nobody_and_withholds_the_originals_credit(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    # No version was kept (CROWDTRAIN_REFEREE_VERSIONS_KEPT is 0 here): nobody can say who is right.
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")

    with django_capture_on_commit_callbacks(execute=True):
        original, _ = _work(campaign, alice.pk, HONEST)
        copy = _lease(campaign, bob.pk)
        ack = reporting.report_done(bob.pk, _done(campaign, copy, FLIPPED)).ack
        while Campaign.objects.get(pk=campaign.pk).committed_steps < 1:
            _work(campaign, bob.pk, HONEST)
        checks.release_credit()

    case = Check.objects.get(lease_id=original.lease_id)
    assert ack.accepted and (ack.verification, case.state) == ("check", Check.State.UNRULED)
    assert "the referee could not recompute it: version 0 was not kept" in case.detail
    assert set(Answer.objects.filter(case=case).values_list("verdict", flat=True)) == {Answer.Verdict.NONE}
    assert not Standing.objects.filter(checks_failed__gt=0).exists(), "nobody failed a check"
    # One of the two answers was wrong and nobody can say which: the original's credit stays withheld, even
    # once Alice is verified (a verified volunteer's made-up lease would be paid otherwise).
    assert _granted(original.lease_id) == 0
    with django_capture_on_commit_callbacks(execute=True):
        _until_passed(campaign, alice.owner_id, [alice.pk, bob.pk])
    assert _granted(original.lease_id) == 0 and checks.withheld([original.lease_id]) == {original.lease_id}


def _until_passed(campaign: Campaign, volunteer_id: int, devices: list[int]) -> None:
    """Honest work and copies by ``devices`` until the volunteer has a check passed."""
    for _ in range(20):
        if Standing.objects.filter(volunteer_id=volunteer_id, checks_passed__gt=0).exists():
            return
        for device_id in devices:
            lease = leasing.request_lease(device_id, campaign.pk, None)
            if isinstance(lease, LeaseMessage):
                assert reporting.report_done(device_id, _done(campaign, lease, HONEST)).ack.accepted
    raise AssertionError(f"volunteer {volunteer_id} passed no check in 20 rounds")


def test_an_abandoned_check_of_a_volunteer_nobody_verified_is_credited_only_after_their_first_pass(
    campaign: Campaign, django_capture_on_commit_callbacks, settings: Any, clock: Any
) -> None:
    # A newcomer who is alone, or first, sees every check abandoned: nobody else can take a copy.
    settings.CROWDTRAIN_CHECK_WAIT_S = 5.0
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    with django_capture_on_commit_callbacks(execute=True):
        first, _ = _work(campaign, alice.pk, HONEST)
        clock.advance(10.0)  # the copy waits past CROWDTRAIN_CHECK_WAIT_S; the next request drops it
        second = _lease(campaign, alice.pk)
        assert not verify_ticket(second.ticket, ticket_key(campaign.pk)).check
        assert reporting.report_done(alice.pk, _done(campaign, second, HONEST)).ack.accepted
        checks.release_credit()
    assert Check.objects.get(lease_id=first.lease_id).state == Check.State.ABANDONED
    assert Lease.objects.filter(pk=first.lease_id, step__isnull=False).exists()
    assert _granted(first.lease_id) == 0, "abandoned, and nothing of hers was ever verified"

    with django_capture_on_commit_callbacks(execute=True):
        _until_passed(campaign, alice.owner_id, [bob.pk, alice.pk])
        checks.release_credit()
    assert _granted(first.lease_id) == first.num_samples


def test_a_second_failed_check_quarantines_drops_pending_work_takes_credit_back_and_refuses_leases(
    django_capture_on_commit_callbacks, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.factories import done_for

    campaign = make_campaign(target_batch_size=64, microbatch_size=4, check_fraction=1.0)  # steps of 8 leases
    mallory, _ = make_device("mallory")
    bob, _ = make_device("bob")
    carol, _ = make_device("carol")
    monkeypatch.setattr(referee, "recompute", lambda case: HONEST)
    with django_capture_on_commit_callbacks(execute=True):
        # Credit from before (granted outright, as if checked long ago), and work accepted but not committed
        # (reported without sketches, so not picked).
        earlier = _lease(campaign, mallory.pk)
        quarantine.ledger.grant(campaign.pk, 1.0, [(earlier.lease_id, mallory.pk, 4)])
        pending = _lease(campaign, mallory.pk)
        assert reporting.report_done(mallory.pk, done_for(pending.lease_id)).ack.accepted
        redo_before = redo_samples(campaign)
        for _ in range(2):
            original, _ = _work(campaign, mallory.pk, NOISE)
            copy = _lease(campaign, bob.pk)
            assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check
            assert reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack.accepted

    standing = Standing.objects.get(volunteer_id=mallory.owner_id)
    assert (standing.checks_failed, standing.rulings_lost) == (2, 2), list(Check.objects.values_list("state", "detail"))
    assert standing.state == Standing.State.QUARANTINED
    assert standing.reason.startswith("2 of 2 of its results the site recomputed disagreed"), standing.reason
    assert CreditEntry.objects.filter(volunteer_id=mallory.owner_id).aggregate(n=Sum("samples"))["n"] == 0
    # The accepted, uncommitted work is out of the step, and its samples wait for someone else.
    assert redo_samples(campaign) >= redo_before + pending.num_samples
    assert Campaign.objects.get(pk=campaign.pk).committed_steps == 0

    refusal = leasing.request_lease(mallory.pk, campaign.pk, None)
    assert isinstance(refusal, NoLease) and refusal.reason == "quarantined"
    assert "/account/standing/" in refusal.detail and "appeal" in refusal.detail
    ack = reporting.report_done(mallory.pk, _done(campaign, original, NOISE)).ack
    assert not ack.accepted and "quarantined" in ack.reason


def test_clearing_gives_the_credit_back_and_a_rollback_after_a_quarantine_takes_nothing_twice(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    alice, _ = make_device("alice")
    lease = _lease(campaign, alice.pk)
    with django_capture_on_commit_callbacks(execute=True):
        quarantine.ledger.grant(campaign.pk, 1.0, [(lease.lease_id, alice.pk, lease.num_samples)])
        assert quarantine.quarantine(alice.owner_id, "test")
        assert not quarantine.quarantine(alice.owner_id, "again"), "already in quarantine"
        quarantine.ledger.reverse([lease.lease_id], "rolled back")  # nothing left to take
        assert _granted(lease.lease_id) == 0
        assert quarantine.clear(alice.owner_id, None)

    assert _granted(lease.lease_id) == 0, "a rollback's reversal is not undone by clearing"
    kinds = sorted(CreditEntry.objects.filter(lease_id=lease.lease_id).values_list("kind", flat=True))
    assert kinds == ["grant", "quarantine"]
    assert Standing.objects.get(volunteer_id=alice.owner_id).state == Standing.State.GOOD


def test_clearing_restores_quarantined_credit(campaign: Campaign, django_capture_on_commit_callbacks) -> None:
    from tests.factories import work_until_committed

    alice, _ = make_device("alice")
    with django_capture_on_commit_callbacks(execute=True):
        work_until_committed(campaign, [alice.pk], steps=1)  # receipts without sketches: credited at commit
        committed = campaign.target_batch_size
        assert _total(alice.owner_id) == committed
        quarantine.quarantine(alice.owner_id, "test")
        assert _total(alice.owner_id) == 0
        assert leasing.request_lease(alice.pk, campaign.pk, None).reason == "quarantined"  # type: ignore[union-attr]
        quarantine.clear(alice.owner_id, None)

    assert _total(alice.owner_id) == committed
    assert isinstance(leasing.request_lease(alice.pk, campaign.pk, None), LeaseMessage)


def _total(volunteer_id: int) -> int:
    return CreditEntry.objects.filter(volunteer_id=volunteer_id).aggregate(n=Sum("samples"))["n"] or 0


def test_a_copy_calls_a_request_waiting_for_a_commit_of_another_volunteer(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    # One fast device can take every lease while the others wait for commits; a copy of its work
    # then waits for a request nobody sends, and leaves the aggregators' window unchecked.
    alice, _ = make_device("alice")
    alice_tablet, _ = make_device("alice", "tablet")
    bob, _ = make_device("bob")
    held = _lease(campaign, alice.pk)  # the whole step: the others wait for its commit
    assert parking.park(campaign.pk, alice_tablet.pk, None, "alice-tablet-waits", 1)
    assert parking.park(campaign.pk, bob.pk, None, "bob-waits", 1)

    with django_capture_on_commit_callbacks(execute=True):
        outcome = reporting.report_done(alice.pk, _done(campaign, held, HONEST))
    assert outcome.ack.verification == "pending"

    # The commit's room (one lease's worth) went to the first in line; the copy called the next, who
    # is not Alice: Bob, who would otherwise have waited for another commit.
    assert [c.woken for c in outcome.commits] == [["alice-tablet-waits"]]
    assert async_to_sync(_received)("bob-waits") == {"type": "lease.wake", "campaign_id": campaign.pk, "copy": True}
    copy = _lease(campaign, bob.pk)
    assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check and copy.ranges == held.ranges


def test_a_copy_given_back_goes_to_another_volunteer(campaign: Campaign) -> None:
    bob, carol, original, copy = _a_verified_volunteers_lease_and_its_copy(campaign)

    endings.release_lease(bob.pk, copy.lease_id, "params no longer served")

    again = _lease(campaign, carol.pk)
    assert verify_ticket(again.ticket, ticket_key(campaign.pk)).check
    assert again.ranges == original.ranges
    assert Check.objects.get(lease_id=original.lease_id).state == Check.State.OPEN


def test_a_copy_whose_version_left_the_aggregators_window_is_not_served_and_ends_without_verdict(
    campaign: Campaign, django_capture_on_commit_callbacks
) -> None:
    from crowdtrain.scheduler.hotstate import hot_state

    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    # Steps went on meanwhile: with staleness 0 the aggregators keep two versions, at most a version behind open.
    state = hot_state()
    open_step = original.base_version + campaign.staleness + 3
    state.client.hset(state.campaign_key(campaign.hot_key.hex) + "meta", "open", open_step)
    assert checks.oldest_copyable(open_step, campaign.staleness) > original.base_version

    with django_capture_on_commit_callbacks(execute=True):
        work = _lease(campaign, bob.pk)

    # Bob gets real work rather than a copy no aggregator can serve parameters for ...
    assert not verify_ticket(work.ticket, ticket_key(campaign.pk)).check
    case = Check.objects.get(lease_id=original.lease_id)
    # ... and the check ends with no verdict on anyone, so Alice's lease is not held back for good.
    assert case.state == Check.State.ABANDONED and "window" in case.detail
    assert not Answer.objects.filter(case=case, role=Answer.Role.COPY).exists()


def test_receipts_without_sketches_are_never_picked(campaign: Campaign) -> None:
    from tests.factories import done_for

    alice, _ = make_device("alice")
    lease = _lease(campaign, alice.pk)
    ack = reporting.report_done(alice.pk, done_for(lease.lease_id)).ack
    assert ack.accepted and ack.verification == ""
    assert not Check.objects.exists()


def test_a_forged_sketch_fails_the_receipt(campaign: Campaign) -> None:
    alice, _ = make_device("alice")
    lease = _lease(campaign, alice.pk)
    done = _done(campaign, lease, HONEST)
    token = done.receipts[0].token
    forged = to_bytes(FLIPPED)
    import base64

    head = base64.urlsafe_b64encode(forged).rstrip(b"=").decode()
    tampered = LeaseDone(
        lease_id=done.lease_id,
        receipts=[Receipt(slice_index=0, token=f"{head}.{token.split('.')[1]}")],
        num_samples=done.num_samples,
        loss_sum=1.0,
        compute_s=0.1,
    )
    ack = reporting.report_done(alice.pk, tampered).ack
    assert not ack.accepted and "receipt" in ack.reason


def test_the_refusal_names_the_standing_page_that_exists() -> None:
    from django.urls import reverse

    from crowdtrain.verification import standing

    assert reverse("standing") == standing.STANDING_PATH


def _copy_reported(campaign: Campaign) -> Check:
    """Alice's lease and Bob's agreeing copy, both reported; the check as it stands after Bob's report."""
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    copy = _lease(campaign, bob.pk)
    assert reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack.accepted
    return Check.objects.get(lease_id=original.lease_id)


def test_with_a_broker_the_verdict_is_the_workers_and_the_report_does_not_wait_for_it(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[int] = []
    monkeypatch.setattr(tasks.judge_check, "delay", handed.append)

    case = _copy_reported(campaign)

    assert case.state == Check.State.OPEN and handed == [case.pk]
    tasks.judge_check(case.pk)  # what the worker runs
    case.refresh_from_db()
    assert case.state == Check.State.PASSED


def test_a_broker_that_is_down_leaves_the_verdict_to_the_reporting_process(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(check_id: int) -> None:
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(tasks.judge_check, "delay", down)

    case = _copy_reported(campaign)

    assert case.state == Check.State.PASSED


def test_a_verdict_whose_task_was_lost_is_reached_by_the_periodic_upkeep(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks.judge_check, "delay", lambda check_id: None)  # accepted, then lost with its worker
    case = _copy_reported(campaign)

    assert checks.judge_ripe() == 0  # its answers are too fresh: the worker may still be on it
    Answer.objects.filter(case=case).update(reported_at=timezone.now() - timedelta(seconds=checks.RIPE_AFTER_S + 1))
    assert checks.judge_ripe() == 1
    case.refresh_from_db()
    assert case.state == Check.State.PASSED
    assert checks.judge_ripe() == 0


def test_a_queue_entry_that_names_the_wrong_volunteers_never_hands_anyone_their_own_lease(
    campaign: Campaign,
) -> None:
    # The record decides who may copy: an entry whose list of excluded volunteers is wrong (left in Redis by
    # another database that reused the check's id, say) must not hand a volunteer their own lease.
    alice, _ = make_device("alice")
    alice_tablet, _ = make_device("alice", "tablet")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    case = Check.objects.get(lease_id=original.lease_id)
    state = hot_state()
    key = f"{state.prefix}:chk:{campaign.pk}"
    stray = {"c": case.pk, "x": [], "u": state.clock() + 60, "v": case.base_version}
    state.client.lpush(key, json.dumps(stray))

    own = _lease(campaign, alice_tablet.pk)
    copy = _lease(campaign, bob.pk)

    assert not verify_ticket(own.ticket, ticket_key(campaign.pk)).check
    assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check and copy.ranges == original.ranges
    assert set(Answer.objects.filter(case=case).values_list("volunteer_id", flat=True)) == {
        alice.owner_id,
        bob.owner_id,
    }


def _batched(monkeypatch: pytest.MonkeyPatch) -> records.RecordWriter:
    """A site process's record writer that writes only when flushed (as its thread would, a moment later)."""
    writer = records.RecordWriter(inline=False, thread=False)
    monkeypatch.setattr(records, "_writer", writer)
    return writer


def test_a_copy_is_handed_out_without_a_query_and_reported_with_one_write(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch, django_assert_num_queries
) -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    writer = _batched(monkeypatch)
    handed: list[int] = []
    monkeypatch.setattr(tasks.judge_check, "delay", handed.append)
    config = campaign_config(campaign.pk)
    assert config is not None
    standing.owner_of(bob.pk)  # known once a device has asked for anything: its first request reads it
    affinity.tags_of(bob.owner_id)  # read once a minute per volunteer

    with django_assert_num_queries(0):
        copy = checks.take_copy(config, bob.pk)
    assert copy is not None and verify_ticket(copy.ticket, ticket_key(campaign.pk)).check
    assert (copy.base_version, copy.ranges, copy.num_samples) == (
        original.base_version,
        original.ranges,
        original.num_samples,
    )
    with django_assert_num_queries(1):  # the answer, written over its row or as it: nothing read
        ack = reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack
    assert (ack.accepted, ack.verification) == (True, "check")
    case = Check.objects.get(lease_id=original.lease_id)
    assert handed == [case.pk]

    writer.flush()  # the issuing process's batch, late: the report stands
    tasks.judge_check(case.pk)

    answer = Answer.objects.get(lease_id=copy.lease_id)
    assert (answer.case_id, answer.role, answer.volunteer_id, answer.device_id) == (
        case.pk,
        Answer.Role.COPY,
        bob.owner_id,
        bob.pk,
    )
    assert answer.reported_at is not None and answer.verdict == Answer.Verdict.AGREED
    case.refresh_from_db()
    assert case.state == Check.State.PASSED


def test_a_copy_issued_by_another_process_whose_batch_is_not_written_yet_is_judged_all_the_same(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    original, _ = _work(campaign, alice.pk, HONEST)
    _batched(monkeypatch)  # the issuing process, whose batch never comes here
    copy = _lease(campaign, bob.pk)
    assert not Answer.objects.filter(lease_id=copy.lease_id).exists()

    assert reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack.accepted

    answer = Answer.objects.get(lease_id=copy.lease_id)
    assert answer.reported_at is not None and answer.verdict == Answer.Verdict.AGREED
    assert Check.objects.get(lease_id=original.lease_id).state == Check.State.PASSED


def test_only_the_device_holding_a_copy_can_report_it_or_give_it_back(campaign: Campaign) -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    mallory, _ = make_device("mallory")
    original, _ = _work(campaign, alice.pk, HONEST)
    copy = _lease(campaign, bob.pk)

    # Lease ids are sequential: another volunteer can guess one, and must find nothing there.
    ack = reporting.report_done(mallory.pk, _done(campaign, copy, FLIPPED)).ack
    assert (ack.accepted, ack.reason) == (False, "unknown lease")
    endings.release_lease(mallory.pk, copy.lease_id, "given back by someone else")
    assert Answer.objects.get(lease_id=copy.lease_id).reported_at is None

    ack = reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack
    assert (ack.accepted, ack.verification) == (True, "check")
    again = reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack
    assert (again.accepted, again.reason) == (False, "unknown lease")
    assert Check.objects.get(lease_id=original.lease_id).state == Check.State.PASSED


def test_a_copy_whose_report_is_refused_goes_to_another_volunteer(campaign: Campaign) -> None:
    bob, carol, original, copy = _a_verified_volunteers_lease_and_its_copy(campaign)
    short = msgspec.structs.replace(_done(campaign, copy, HONEST), num_samples=copy.num_samples - 1)

    ack = reporting.report_done(bob.pk, short).ack

    assert not ack.accepted and "receipt" in ack.reason  # the receipts sign the samples the copy had
    assert Answer.objects.get(lease_id=copy.lease_id).verdict == Answer.Verdict.NONE
    assert not verify_ticket(_lease(campaign, bob.pk).ticket, ticket_key(campaign.pk)).check, "bob had his turn"
    again = _lease(campaign, carol.pk)
    assert verify_ticket(again.ticket, ticket_key(campaign.pk)).check and again.ranges == original.ranges


def test_an_answer_the_database_refuses_is_dropped_and_the_rest_of_its_batch_is_written(
    campaign: Campaign, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    _work(campaign, alice.pk, HONEST)
    writer = _batched(monkeypatch)
    copy = _lease(campaign, bob.pk)
    bad = Answer(case=Check.objects.get(), lease_id=copy.lease_id + 1000, role=Answer.Role.COPY, volunteer_id=None)
    writer.copy_issued(bad)

    writer.flush()

    assert Answer.objects.filter(lease_id=copy.lease_id).exists()
    assert not Answer.objects.filter(lease_id=bad.lease_id).exists()
    writer.flush()  # nothing held back for another try
    assert not writer._copies


def test_a_copy_whose_marker_names_no_holder_is_reported_by_the_holder_on_record_only(campaign: Campaign) -> None:
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    mallory, _ = make_device("mallory")
    original, _ = _work(campaign, alice.pk, HONEST)
    copy = _lease(campaign, bob.pk)
    state = hot_state()
    # The bare marker a site before 2.9 wrote: the answer row says who holds the copy.
    state.client.hset(state.lease_campaigns_key, str(copy.lease_id), checks.copy_marker(campaign.pk))

    stranger = reporting.report_done(mallory.pk, _done(campaign, copy, FLIPPED)).ack
    holder = reporting.report_done(bob.pk, _done(campaign, copy, HONEST)).ack

    assert (stranger.accepted, stranger.reason) == (False, "unknown lease")
    assert (holder.accepted, holder.verification) == (True, "check")
    assert Check.objects.get(lease_id=original.lease_id).state == Check.State.PASSED

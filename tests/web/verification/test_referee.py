"""The referee recomputes a lease as an honest agent would, and its rulings are bounded.

The agent's side here is the agent's own code (model cache, shard reader,
``compute_gradient``, the codec) and the aggregator's side its own decode and
sketch (``crowdtrain_backbone.uploads``): the referee must agree with an honest
upload bit for bit up to arithmetic noise, and with nothing else.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from django.core.files.storage import default_storage
from django.test import override_settings
from django.utils import timezone

from crowdtrain.campaigns import validation
from crowdtrain.campaigns.keys import ticket_key
from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import shard_storage_name
from crowdtrain.scheduler import leasing, reporting
from crowdtrain.scheduler.configs import campaign_config
from crowdtrain.verification import checks, referee
from crowdtrain.verification.models import Answer, Check, KeptVersion, Standing
from crowdtrain_agent import trainer
from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.data import ShardReader
from crowdtrain_agent.protocol import Lease as LeaseMessage
from crowdtrain_agent.protocol import LeaseDone, Receipt, sign_receipt, verify_ticket
from crowdtrain_agent.sketch import compare, from_bytes, sketch_seed
from crowdtrain_backbone.uploads import check_and_sketch, decode_gradient
from tests.factories import make_campaign, make_device

pytestmark = pytest.mark.django_db


def _params(campaign: Campaign) -> torch.Tensor:
    torch.manual_seed(campaign.pk)
    config = campaign_config(campaign.pk)
    assert config is not None
    cm = trainer.ModelCache(torch.device("cpu")).get(campaign.pk, config.model)
    return torch.nn.utils.parameters_to_vector(cm.model.parameters()).detach().clone()


def _upload_sketches(
    campaign: Campaign, lease: LeaseMessage, flat: torch.Tensor, *, tamper: float = 1.0, microbatch: int | None = None
) -> list[bytes]:
    """What the aggregators sign for an agent's upload of ``lease``: the agent's gradient (times ``tamper``),
    through the lease's codec, decoded and sketched as an aggregator does."""
    cm = trainer.ModelCache(torch.device("cpu")).get(lease.campaign_id, lease.model)
    trainer.load_params_(cm, flat, lease.base_version)
    readers = {}
    for r in lease.ranges:
        with default_storage.open(shard_storage_name(r.shard), "rb") as fh:
            readers[r.shard] = ShardReader(lease.data, fh.read())
    x, y = trainer.gather_samples(lease.ranges, readers, augment=lease.data.augment, version=lease.base_version)
    grad = trainer.compute_gradient(cm, x, y, microbatch or lease.microbatch_size).grad * tamper
    codec = get_codec(lease.codec, lease.codec_block_size)
    ticket = verify_ticket(lease.ticket, ticket_key(campaign.pk))
    sketches = []
    for route in lease.slices:
        piece = grad[route.start : route.end].contiguous()
        received = decode_gradient(codec, bytearray(codec.encode(piece)), piece.numel(), ticket)
        seed = sketch_seed(ticket_key(campaign.pk), route.index, lease.base_version)
        sketches.append(check_and_sketch(received, ticket, 0.0, seed)[1])
    return sketches


def _done(campaign: Campaign, lease: LeaseMessage, sketches: list[bytes]) -> LeaseDone:
    receipts = [
        Receipt(
            slice_index=route.index,
            token=sign_receipt(ticket_key(campaign.pk), campaign_id=campaign.pk, lease_id=lease.lease_id,
                               slice_index=route.index, num_samples=lease.num_samples, sketch=part),
        )
        for route, part in zip(lease.slices, sketches, strict=True)
    ]  # fmt: skip
    return LeaseDone(lease_id=lease.lease_id, receipts=receipts, num_samples=lease.num_samples, loss_sum=1.0,
                     compute_s=0.1)  # fmt: skip


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Versions are kept; the aggregators' params endpoint is the one part replaced (no aggregator runs here)."""
    served: dict[str, Any] = {"fetches": 0, "flat": None}

    def fetch(campaign: Campaign, version: int) -> torch.Tensor:
        served["fetches"] += 1
        if served["flat"] is None:
            raise validation.ParamsUnavailable(f"campaign {campaign.pk} version {version}: gone")
        return served["flat"]

    monkeypatch.setattr(validation, "fetch_campaign_params", fetch)
    with override_settings(CROWDTRAIN_REFEREE_VERSIONS_KEPT=4):
        yield served


def _first_lease(campaign: Campaign, device_id: int) -> LeaseMessage:
    lease = leasing.request_lease(device_id, campaign.pk, None)
    assert isinstance(lease, LeaseMessage), lease
    return lease


@pytest.mark.parametrize(("codec", "slices"), [("fp32", 1), ("fp16", 2), ("int8", 2)])
def test_the_referee_agrees_with_an_honest_upload_and_with_nothing_else(
    kept: dict[str, Any], django_capture_on_commit_callbacks, codec: str, slices: int
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0, codec=codec, slices=slices)
    kept["flat"] = flat = _params(campaign)
    alice, _ = make_device("alice")
    lease = _first_lease(campaign, alice.pk)
    with django_capture_on_commit_callbacks(execute=True):
        # Another summation order than the referee's (microbatches of 1, not 4): honest noise.
        report = _done(campaign, lease, _upload_sketches(campaign, lease, flat, microbatch=1))
        assert reporting.report_done(alice.pk, report).ack.verification == "pending"
    case = Check.objects.get(lease_id=lease.lease_id)
    assert KeptVersion.objects.filter(campaign=campaign, version=case.base_version).exists()

    ruling = referee.recompute(case)
    honest = [x for part in _upload_sketches(campaign, lease, flat) for x in from_bytes(part)]
    flipped = [x for part in _upload_sketches(campaign, lease, flat, tamper=-1.0) for x in from_bytes(part)]
    scaled = [x for part in _upload_sketches(campaign, lease, flat, tamper=1.5) for x in from_bytes(part)]
    agreement = compare(honest, ruling)
    assert agreement.agrees() and agreement.cosine > 0.9999, agreement
    assert not compare(flipped, ruling).agrees() and not compare(scaled, ruling).agrees()


def test_a_made_up_copy_loses_its_ruling_against_an_honest_original_with_the_real_recomputation(
    kept: dict[str, Any], django_capture_on_commit_callbacks
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0)
    kept["flat"] = flat = _params(campaign)
    alice, _ = make_device("alice")
    mallory, _ = make_device("mallory")
    with django_capture_on_commit_callbacks(execute=True):
        original = _first_lease(campaign, alice.pk)
        reporting.report_done(alice.pk, _done(campaign, original, _upload_sketches(campaign, original, flat)))
        copy = _first_lease(campaign, mallory.pk)
        assert verify_ticket(copy.ticket, ticket_key(campaign.pk)).check
        made_up = _upload_sketches(campaign, copy, flat, tamper=-3.0)
        assert reporting.report_done(mallory.pk, _done(campaign, copy, made_up)).ack.accepted

    case = Check.objects.get(lease_id=original.lease_id)
    assert case.state == Check.State.PASSED, case.detail
    verdicts = dict(Answer.objects.filter(case=case).values_list("volunteer_id", "verdict"))
    assert verdicts == {alice.owner_id: Answer.Verdict.AGREED, mallory.owner_id: Answer.Verdict.DISAGREED}
    assert Standing.objects.get(volunteer_id=mallory.owner_id).rulings_lost == 1
    assert Standing.objects.get(volunteer_id=alice.owner_id).rulings_won == 1


def test_a_check_nobody_copied_is_ruled_on_by_the_referee_alone(
    kept: dict[str, Any], django_capture_on_commit_callbacks
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0)
    kept["flat"] = flat = _params(campaign)
    mallory, _ = make_device("mallory")
    with django_capture_on_commit_callbacks(execute=True):
        lease = _first_lease(campaign, mallory.pk)
        reporting.report_done(mallory.pk, _done(campaign, lease, _upload_sketches(campaign, lease, flat, tamper=-1.0)))
        checks.unanswered(Check.objects.get(lease_id=lease.lease_id).pk, "no volunteer took its copy in time")

    case = Check.objects.get(lease_id=lease.lease_id)
    assert case.state == Check.State.FAILED and "no volunteer took its copy in time" in case.detail
    assert Standing.objects.get(volunteer_id=mallory.owner_id).rulings_lost == 1


def test_a_version_is_fetched_once_for_all_its_checks_and_pruned_once_none_needs_it(
    kept: dict[str, Any], django_capture_on_commit_callbacks
) -> None:
    campaign = make_campaign(target_batch_size=32, microbatch_size=4, check_fraction=1.0)
    kept["flat"] = flat = _params(campaign)
    alice, _ = make_device("alice")
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(3):  # three checks of version 0
            lease = _first_lease(campaign, alice.pk)
            reporting.report_done(alice.pk, _done(campaign, lease, _upload_sketches(campaign, lease, flat)))
    assert Check.objects.filter(base_version=0).count() == 3 and kept["fetches"] == 1
    name = KeptVersion.objects.get(campaign=campaign, version=0).name
    assert default_storage.exists(name)

    long_ago = timezone.now() - timedelta(seconds=referee.PRUNE_GRACE_S + 60)
    KeptVersion.objects.update(created_at=long_ago)
    assert referee.prune() == 0, "open checks still need it"
    Check.objects.update(state=Check.State.PASSED)
    assert referee.prune() == 0, "a check opened on it lately: another may be opening, its process asked already"
    Check.objects.update(created_at=long_ago)
    assert referee.prune() == 1
    assert not KeptVersion.objects.exists() and not default_storage.exists(name)


def test_a_version_the_aggregators_no_longer_serve_leaves_its_disputes_without_a_verdict(
    kept: dict[str, Any], django_capture_on_commit_callbacks
) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0)
    flat = _params(campaign)  # kept["flat"] stays None: the fetch fails as for a version gone
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    with django_capture_on_commit_callbacks(execute=True):
        original = _first_lease(campaign, alice.pk)
        reporting.report_done(alice.pk, _done(campaign, original, _upload_sketches(campaign, original, flat)))
        copy = _first_lease(campaign, bob.pk)
        reporting.report_done(bob.pk, _done(campaign, copy, _upload_sketches(campaign, copy, flat, tamper=-1.0)))
    case = Check.objects.get(lease_id=original.lease_id)
    assert case.state == Check.State.UNRULED and "was not kept" in case.detail
    assert not Standing.objects.filter(checks_failed__gt=0).exists()


def test_rulings_over_a_bound_wait_oldest_first_and_an_uncopied_check_is_given_up(
    kept: dict[str, Any], django_capture_on_commit_callbacks
) -> None:
    campaign = make_campaign(target_batch_size=32, microbatch_size=4, check_fraction=1.0)
    kept["flat"] = flat = _params(campaign)
    alice, _ = make_device("alice")
    bob, _ = make_device("bob")
    with (
        override_settings(CROWDTRAIN_REFEREE_VOLUNTEER_RULINGS_PER_HOUR=1),
        django_capture_on_commit_callbacks(execute=True),
    ):
        cases = []
        for _ in range(2):  # two disputes between the same volunteers: the second waits
            original = _first_lease(campaign, alice.pk)
            reporting.report_done(alice.pk, _done(campaign, original, _upload_sketches(campaign, original, flat)))
            copy = _first_lease(campaign, bob.pk)
            bad = _upload_sketches(campaign, copy, flat, tamper=-1.0)
            reporting.report_done(bob.pk, _done(campaign, copy, bad))
            cases.append(Check.objects.get(lease_id=original.lease_id))
        uncopied = _first_lease(campaign, alice.pk)
        reporting.report_done(alice.pk, _done(campaign, uncopied, _upload_sketches(campaign, uncopied, flat)))
        checks.unanswered(Check.objects.get(lease_id=uncopied.lease_id).pk, "nobody came")

    first, second = (Check.objects.get(pk=c.pk) for c in cases)
    assert first.state == Check.State.PASSED
    assert second.state == Check.State.REFEREE and second.refereed_at is None, second.detail
    given_up = Check.objects.get(lease_id=uncopied.lease_id)
    assert given_up.state == Check.State.ABANDONED and "the referee was busy" in given_up.detail

    # An hour on, the bound is free again: the upkeep rules on the waiting dispute.
    Check.objects.filter(pk=first.pk).update(refereed_at=timezone.now() - timedelta(hours=2))
    Check.objects.filter(pk=second.pk).update(disputed_at=timezone.now() - timedelta(minutes=1))
    with (
        override_settings(CROWDTRAIN_REFEREE_VOLUNTEER_RULINGS_PER_HOUR=1),
        django_capture_on_commit_callbacks(execute=True),
    ):
        assert referee.waiting() == 1
    assert Check.objects.get(pk=second.pk).state == Check.State.PASSED
    assert Standing.objects.get(volunteer_id=bob.owner_id).rulings_lost == 2


def test_a_dispute_that_waits_past_its_time_ends_without_a_verdict(kept: dict[str, Any]) -> None:
    campaign = make_campaign(target_batch_size=8, microbatch_size=4, check_fraction=1.0)
    alice, _ = make_device("alice")
    case = Check.objects.create(campaign=campaign, lease_id=10**9, volunteer_id=alice.owner_id, base_version=0,
                                ranges=[[0, 0, 0, 4]], num_samples=4, state=Check.State.REFEREE,
                                detail="the copy disagrees", disputed_at=timezone.now() - timedelta(hours=2),
                                refereed_at=timezone.now())  # fmt: skip
    referee.waiting()
    case.refresh_from_db()
    assert case.state == Check.State.ABANDONED and "waited too long for the referee" in case.detail

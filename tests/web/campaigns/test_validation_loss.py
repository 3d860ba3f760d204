"""The held-out loss: computed from the fetched parameters, bounded, stored once, and it can finish a campaign."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from django.core.files.storage import default_storage
from django.test import Client, override_settings
from django.urls import reverse
from torch.nn import functional as F

from crowdtrain.campaigns import lifecycle, validation
from crowdtrain.campaigns.models import Campaign, ValidationResult
from crowdtrain.campaigns.tasks import compute_validation_loss
from crowdtrain.datasets.sharding import create_text_dataset
from crowdtrain.scheduler import backbone
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import StepApplied
from tests.factories import TINY_GPT, make_campaign

pytestmark = pytest.mark.django_db

SAMPLE_LEN = 9
TEXT = bytes((i * 7 + 3) % 251 for i in range(100 * SAMPLE_LEN))  # 100 samples: 80 train, 20 held out


def _campaign(**fields: object) -> Campaign:
    dataset = create_text_dataset("held-out", TEXT, SAMPLE_LEN, shard_bytes=8 * SAMPLE_LEN, validation_fraction=0.2)
    return make_campaign(dataset, seed=7, **fields)


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The aggregators answer with the seeded initial parameters; records each version asked for."""
    calls: list[int] = []

    def fetch(campaign: Campaign, version: int) -> torch.Tensor:
        calls.append(version)
        model = get_model(campaign.architecture).build(campaign.model_config, seed=campaign.seed)
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    monkeypatch.setattr(validation, "fetch_campaign_params", fetch)
    return calls


def _expected_loss(samples: int) -> float:
    model = get_model("gpt").build(TINY_GPT, seed=7)
    held_out = torch.tensor(list(TEXT[80 * SAMPLE_LEN : (80 + samples) * SAMPLE_LEN])).view(samples, SAMPLE_LEN)
    with torch.no_grad():
        logits = model(held_out[:, :-1])
    return float(F.cross_entropy(logits.reshape(-1, 256), held_out[:, 1:].reshape(-1)))


def test_it_stores_the_mean_loss_of_the_parameters_on_the_held_out_split(fetched: list[int]) -> None:
    campaign = _campaign()

    loss = compute_validation_loss(campaign.pk, 10)

    result = ValidationResult.objects.get(campaign=campaign, version=10)
    assert result.num_samples == 20 and fetched == [10]
    assert loss == result.loss == pytest.approx(_expected_loss(20), rel=1e-6)
    assert result.weights == validation.export_name(campaign.pk, 10)


def test_it_evaluates_at_most_the_configured_number_of_samples(fetched: list[int]) -> None:
    campaign = _campaign()

    with override_settings(CROWDTRAIN_VALIDATION_SAMPLES=3):
        loss = compute_validation_loss(campaign.pk, 10)

    assert ValidationResult.objects.get(campaign=campaign).num_samples == 3
    assert loss == pytest.approx(_expected_loss(3), rel=1e-6)


def test_a_version_is_validated_once(fetched: list[int]) -> None:
    campaign = _campaign()
    first = compute_validation_loss(campaign.pk, 10)

    again = compute_validation_loss(campaign.pk, 10)

    assert again == first and fetched == [10]
    assert ValidationResult.objects.filter(campaign=campaign).count() == 1


def test_reaching_the_target_validation_loss_finishes_the_campaign(fetched: list[int]) -> None:
    campaign = _campaign(target_val_loss=100.0)

    compute_validation_loss(campaign.pk, 10)

    assert Campaign.objects.get(pk=campaign.pk).state == Campaign.State.FINISHED


def test_a_loss_above_the_target_keeps_it_running(fetched: list[int]) -> None:
    campaign = _campaign(target_val_loss=0.01)

    compute_validation_loss(campaign.pk, 10)

    assert Campaign.objects.get(pk=campaign.pk).state == Campaign.State.RUNNING


def test_a_vanished_campaign_is_skipped(fetched: list[int]) -> None:
    assert compute_validation_loss(987654, 10) is None
    assert fetched == []


def test_a_version_the_aggregators_no_longer_hold_is_skipped() -> None:
    campaign = _campaign()  # the factory's aggregators listen nowhere (port 1)

    loss = compute_validation_loss(campaign.pk, 10)

    assert loss is None and not ValidationResult.objects.exists()


def test_a_dataset_without_a_held_out_split_still_exports_but_has_no_loss(fetched: list[int]) -> None:
    campaign = make_campaign(seed=7)

    loss = compute_validation_loss(campaign.pk, 10)

    result = ValidationResult.objects.get(campaign=campaign)
    assert loss is None and result.loss is None and result.num_samples == 0 and result.weights


def _apply(campaign: Campaign, version: int) -> None:
    # The step was committed first, as always: a slice reply for a step the site does not have is ignored.
    Campaign.objects.filter(pk=campaign.pk, committed_steps__lt=version).update(committed_steps=version)
    s = campaign.slices.get()
    backbone.step_applied(s.aggregator_id, StepApplied(campaign_id=campaign.pk, slice_index=0, step=version - 1,
                                                       version=version))  # fmt: skip


def test_every_validate_every_steps_and_the_last_step_are_validated(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Callable
) -> None:
    campaign = _campaign(validate_every=3, max_steps=7)
    queued: list[int] = []
    monkeypatch.setattr(validation, "schedule_validation", lambda cid, version: queued.append(version))

    for version in range(1, 8):
        _apply(campaign, version)

    assert queued == [3, 6, 7]


def test_in_eager_mode_the_task_runs_off_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Callable
) -> None:
    ran: list[str] = []
    done = threading.Event()

    def compute(campaign_id: int, version: int) -> None:
        ran.append(threading.current_thread().name)
        done.set()

    monkeypatch.setattr(validation, "compute", compute)

    with override_settings(CELERY_TASK_ALWAYS_EAGER=True), django_capture_on_commit_callbacks(execute=True):
        validation.schedule_validation(5, 30)

    assert done.wait(5.0)
    assert ran == ["validate-5-30"]


def test_the_progress_json_carries_the_validation_losses() -> None:
    campaign = _campaign()
    ValidationResult.objects.create(campaign=campaign, version=20, loss=2.5, num_samples=20)
    ValidationResult.objects.create(campaign=campaign, version=10, loss=3.5, num_samples=20)
    ValidationResult.objects.create(campaign=campaign, version=30, loss=None, num_samples=0)

    body = Client().get(reverse("campaign-progress", args=[campaign.pk])).json()

    assert body["val_loss"] == [
        {"version": 10, "loss": 3.5, "num_samples": 20},
        {"version": 20, "loss": 2.5, "num_samples": 20},
    ]


def test_only_the_newest_exports_keep_their_weights(fetched: list[int]) -> None:
    campaign = _campaign()

    with override_settings(CROWDTRAIN_EXPORTS_KEPT=2):
        for version in (10, 20, 30):
            compute_validation_loss(campaign.pk, version)

    results = {r.version: r for r in ValidationResult.objects.filter(campaign=campaign)}
    assert [v for v, r in sorted(results.items()) if r.weights] == [20, 30]
    assert results[10].loss is not None
    assert not default_storage.exists(validation.export_name(campaign.pk, 10))
    assert default_storage.exists(validation.export_name(campaign.pk, 30))


def test_finishing_by_hand_validates_the_final_version(monkeypatch: pytest.MonkeyPatch) -> None:
    campaign = _campaign()
    campaign.version = 7
    campaign.save(update_fields=["version"])
    queued: list[tuple[int, int]] = []
    monkeypatch.setattr(lifecycle, "schedule_validation", lambda cid, version: queued.append((cid, version)))

    lifecycle.apply_move(campaign.pk, "finish", campaign.owner)

    assert queued == [(campaign.pk, 7)]


def test_a_version_applied_after_finishing_by_hand_is_validated_too(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Callable
) -> None:
    campaign = _campaign(validate_every=10, max_steps=100)
    queued: list[int] = []
    monkeypatch.setattr(validation, "schedule_validation", lambda cid, version: queued.append(version))
    monkeypatch.setattr(lifecycle, "schedule_validation", lambda cid, version: queued.append(version))
    _apply(campaign, 1)
    _apply(campaign, 2)

    lifecycle.apply_move(campaign.pk, "finish", campaign.owner)
    _apply(campaign, 3)  # a step committed before the click, applied by the aggregator after it

    assert queued == [2, 3], "the weights the campaign ends with must be exported"

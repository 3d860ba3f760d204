"""The campaign form: registry-driven model fields, optimizer and schedule, stop rule; bad values save nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client

from crowdtrain.campaigns.models import Campaign
from crowdtrain.datasets.models import Dataset
from crowdtrain.datasets.sharding import create_tensor_dataset
from tests.factories import make_campaign, make_organizer

pytestmark = pytest.mark.django_db


def valid_post(dataset: Dataset, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "Tiny GPT",
        "description": "bytes in, bytes out",
        "visibility": "public",
        "dataset": dataset.pk,
        "architecture": "gpt",
        "gpt__n_layer": 1,
        "gpt__n_head": 1,
        "gpt__n_embd": 8,
        "gpt__block_size": 8,
        "mlp__in_dim": 256,
        "mlp__hidden": "1024, 1024",
        "mlp__classes": 10,
        "optimizer": "adamw",
        "lr": 0.003,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.9,
        "warmup_steps": 0,
        "schedule": "constant",
        "min_lr_ratio": 0.0,
        "target_batch_size": 32,
        "microbatch_size": 4,
        "codec": "fp32",
        "max_steps": 20,
        "target_val_loss": "",
        "seed": 7,
        "num_aggregators": 1,
        "staleness": 1,
        "checkpoint_every": 10,
        "validate_every": 10,
        "max_grad_norm": 1e4,
    }
    data.update(overrides)
    return data


def test_the_form_renders_each_architectures_fields_from_the_registry(organizer_client: Client) -> None:
    page = organizer_client.get("/campaigns/new")

    html = page.content.decode()
    assert page.status_code == 200
    for name in ("gpt__n_layer", "gpt__n_head", "gpt__n_embd", "gpt__block_size", "mlp__in_dim", "mlp__hidden"):
        assert f'name="{name}"' in html
    assert 'data-architecture="mlp"' in html
    assert '<option value="lamb"' in html and '<option value="sgd"' in html
    assert "js/campaign-form.js" in html


def test_an_organizer_creates_a_draft_campaign(organizer_client: Client, text_dataset: Dataset) -> None:
    response = organizer_client.post(
        "/campaigns/new",
        valid_post(
            text_dataset,
            optimizer="lamb",
            schedule="cosine",
            warmup_steps=5,
            min_lr_ratio=0.1,
            target_val_loss=2.5,
            validate_every=4,
        ),
    )

    campaign = Campaign.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/campaigns/{campaign.pk}/"
    assert campaign.state == Campaign.State.DRAFT
    assert campaign.owner.username == "olga"
    assert campaign.model_config == {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8}
    assert campaign.optimizer["name"] == "lamb" and campaign.optimizer["schedule"] == "cosine"
    assert campaign.optimizer["warmup_steps"] == 5 and campaign.optimizer["total_steps"] == 20
    assert campaign.optimizer["lr"] == pytest.approx(0.003)
    assert campaign.param_count > 0 and campaign.seed == 7
    assert campaign.max_steps == 20 and campaign.target_val_loss == pytest.approx(2.5)
    assert campaign.validate_every == 4


def test_an_invite_only_campaign_gets_an_invite_code(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset, visibility="invite"))

    campaign = Campaign.objects.get()
    assert campaign.visibility == Campaign.Visibility.INVITE
    assert len(campaign.invite_code) >= 32


def test_sgd_reads_momentum_and_ignores_the_adam_betas(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset, optimizer="sgd", momentum=0.8, beta1="junk"))

    optimizer = Campaign.objects.get().optimizer
    assert optimizer["name"] == "sgd" and optimizer["momentum"] == pytest.approx(0.8)


def test_an_mlp_campaign_reads_its_hidden_widths_from_a_comma_list(
    organizer_client: Client, olga: AbstractBaseUser
) -> None:
    rng = np.random.default_rng(0)
    tensors = create_tensor_dataset("blobs", rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64))
    Dataset.objects.filter(pk=tensors.pk).update(owner=olga)

    organizer_client.post(
        "/campaigns/new",
        valid_post(
            tensors,
            architecture="mlp",
            mlp__in_dim=4,
            mlp__hidden="16, 8",
            mlp__classes=3,
            gpt__n_layer="",
        ),
    )

    assert Campaign.objects.get().model_config == {"in_dim": 4, "hidden": [16, 8], "classes": 3}


BAD_FIELDS = [
    ("name", {"name": ""}, "Name is required"),
    ("visibility", {"visibility": "secret"}, "Visibility"),
    ("architecture", {"architecture": "alexnet"}, "Architecture"),
    ("gpt__n_layer", {"gpt__n_layer": 0}, "gpt.n_layer must be between"),
    ("gpt__n_layer", {"gpt__n_layer": ""}, "gpt.n_layer is required"),
    ("gpt__n_head", {"gpt__n_head": "two"}, "gpt.n_head"),
    ("gpt__n_embd", {"gpt__n_embd": 9, "gpt__n_head": 2}, "gpt.n_embd (9) must be divisible by gpt.n_head"),
    ("gpt__block_size", {"gpt__block_size": 16}, "dataset's sample length 9"),
    ("dataset", {"architecture": "mlp"}, "mlp trains on tensors data"),
    ("optimizer", {"optimizer": "adam"}, "Optimizer"),
    ("lr", {"lr": 0}, "Learning rate (optimizer.lr) must be above 0 and at most 10, got 0.0"),
    ("lr", {"lr": 100}, "Learning rate (optimizer.lr) must be above 0 and at most 10, got 100.0"),
    ("lr", {"lr": "fast"}, "Learning rate: enter a number"),
    ("lr", {"lr": "inf"}, "Learning rate"),
    ("beta1", {"beta1": 1.0}, "optimizer.beta1 must be at least 0 and below 1"),
    ("beta2", {"beta2": -0.1}, "optimizer.beta2 must be at least 0 and below 1"),
    ("eps", {"eps": 0}, "optimizer.eps must be above 0"),
    ("weight_decay", {"weight_decay": -1}, "Weight decay (optimizer.weight_decay) must be between 0 and 1"),
    ("momentum", {"optimizer": "sgd", "momentum": 1.5}, "Momentum (optimizer.momentum) must be at least 0 and below 1"),
    ("warmup_steps", {"warmup_steps": -1}, "Warmup steps (optimizer.warmup_steps) must be between 0 and"),
    ("warmup_steps", {"warmup_steps": 20}, "(optimizer.warmup_steps) is 20, but must be fewer than max steps (20)"),
    ("schedule", {"schedule": "cosine", "max_steps": "", "target_val_loss": 1.0}, "a cosine schedule decays until"),
    ("schedule", {"schedule": "step"}, "Schedule"),
    ("min_lr_ratio", {"min_lr_ratio": 2}, "Minimum LR ratio (optimizer.min_lr_ratio) must be between 0 and 1"),
    ("target_batch_size", {"target_batch_size": 0}, "Target batch size (target_batch_size) must be between 1 and"),
    ("microbatch_size", {"microbatch_size": 64}, "Microbatch size (64) must be at least 1 and must not exceed the"),
    ("codec", {"codec": "int4"}, "Gradient codec"),
    ("max_steps", {"max_steps": "", "target_val_loss": ""}, "Set a stop rule"),
    ("max_steps", {"max_steps": 0}, "Max steps (max_steps) must be between 1 and"),
    ("target_val_loss", {"target_val_loss": -1}, "Target validation loss (target_val_loss) must be above 0"),
    ("target_val_loss", {"target_val_loss": "nan"}, "Target validation loss"),
    ("validate_every", {"validate_every": -1}, "Validate every (validate_every) must be between 0 and"),
    ("seed", {"seed": -3}, "Seed (seed) must be between 0 and"),
    ("num_aggregators", {"num_aggregators": 0}, "Aggregators (num_aggregators) must be between 1 and 64"),
    ("num_aggregators", {"optimizer": "lamb", "num_aggregators": 64}, "LAMB gives each aggregator whole parameter"),
    ("staleness", {"staleness": 9}, "Staleness (staleness) must be between 0 and 4"),
    ("checkpoint_every", {"checkpoint_every": 0}, "Checkpoint every (checkpoint_every) must be between 1 and"),
    ("max_grad_norm", {"max_grad_norm": -1}, "Max gradient norm (max_grad_norm) must be between 0 and"),
    ("aggregation", {"aggregation": "median"}, "Aggregation"),
    ("clip_factor", {"clip_factor": -1}, "Clip factor (clip_factor) must be between 0 and"),
    ("trim_fraction", {"trim_fraction": 0.6}, "Trim fraction (trim_fraction) must be at least 0 and below 0.5"),
    ("trim_fraction", {"trim_fraction": 0.5}, "Trim fraction (trim_fraction) must be at least 0 and below 0.5"),
    ("trim_fraction", {"trim_fraction": -0.1}, "Trim fraction (trim_fraction) must be at least 0 and below 0.5"),
    ("check_fraction", {"check_fraction": 1.5}, "Check fraction (check_fraction) must be between 0 and 1"),
]


@pytest.mark.parametrize(("field", "overrides", "message"), BAD_FIELDS, ids=[f"{f}-{m[:20]}" for f, _, m in BAD_FIELDS])
def test_each_bad_field_gets_an_inline_error_naming_it_and_nothing_is_saved(
    organizer_client: Client, text_dataset: Dataset, field: str, overrides: dict[str, Any], message: str
) -> None:
    response = organizer_client.post("/campaigns/new", valid_post(text_dataset, **overrides))

    assert response.status_code == 200
    errors = response.context["form"].errors
    assert field in errors, errors
    assert any(message in e for e in errors[field]), errors[field]
    html = response.content.decode()
    assert f'id="id_{field}_error"' in html  # shown next to its field, not only at the top
    assert "Nothing was saved" in html
    assert Campaign.objects.count() == 0


def test_another_organizers_dataset_cannot_be_chosen(organizer_client: Client, text_dataset: Dataset) -> None:
    Dataset.objects.filter(pk=text_dataset.pk).update(owner=make_organizer("other"))

    response = organizer_client.post("/campaigns/new", valid_post(text_dataset))

    assert "dataset" in response.context["form"].errors
    assert Campaign.objects.count() == 0


def test_a_dataset_still_being_sharded_cannot_be_chosen(organizer_client: Client, text_dataset: Dataset) -> None:
    Dataset.objects.filter(pk=text_dataset.pk).update(status="sharding")

    page = organizer_client.get("/campaigns/new")
    response = organizer_client.post("/campaigns/new", valid_post(text_dataset))

    assert f'<option value="{text_dataset.pk}"' not in page.content.decode()
    assert "dataset" in response.context["form"].errors
    assert Campaign.objects.count() == 0


def test_a_draft_can_change_its_model(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset))
    campaign = Campaign.objects.get()

    organizer_client.post(f"/campaigns/{campaign.pk}/edit", valid_post(text_dataset, gpt__n_embd=16, lr=0.01))

    campaign.refresh_from_db()
    assert campaign.model_config["n_embd"] == 16 and campaign.optimizer["lr"] == pytest.approx(0.01)


def test_a_running_campaign_locks_model_settings_and_says_why(organizer_client: Client, text_dataset: Dataset) -> None:
    organizer_client.post("/campaigns/new", valid_post(text_dataset))
    campaign = Campaign.objects.get()
    Campaign.objects.filter(pk=campaign.pk).update(state=Campaign.State.RUNNING, committed_steps=3)

    page = organizer_client.get(f"/campaigns/{campaign.pk}/edit")
    response = organizer_client.post(
        f"/campaigns/{campaign.pk}/edit",
        valid_post(
            text_dataset,
            name="Renamed",
            max_steps=50,
            target_val_loss=1.5,
            gpt__n_embd=16,
            lr=0.5,
            codec="fp16",
            target_batch_size=64,
            visibility="invite",
        ),
    )

    campaign.refresh_from_db()
    html = page.content.decode()
    assert "would break the model" in html
    assert 'name="gpt__n_embd"' in html and "disabled" in html.split('name="gpt__n_embd"')[1].split(">")[0]
    assert response.status_code == 302
    assert campaign.name == "Renamed" and campaign.max_steps == 50 and campaign.target_val_loss == pytest.approx(1.5)
    assert campaign.visibility == Campaign.Visibility.INVITE and campaign.invite_code
    assert campaign.model_config["n_embd"] == 8 and campaign.optimizer["lr"] == pytest.approx(0.003)
    assert campaign.codec == "fp32" and campaign.target_batch_size == 32


def test_max_steps_cannot_drop_below_the_steps_already_made(organizer_client: Client, olga: AbstractBaseUser) -> None:
    campaign = make_campaign(max_steps=100)
    Campaign.objects.filter(pk=campaign.pk).update(owner=olga, committed_steps=30)

    response = organizer_client.post(f"/campaigns/{campaign.pk}/edit", valid_post(campaign.dataset, max_steps=30))

    assert "Max steps must be more than the 30 steps already made" in response.context["form"].errors["max_steps"][0]
    campaign.refresh_from_db()
    assert campaign.max_steps == 100


def test_model_settings_are_labelled_in_words_with_their_config_names(client: Client) -> None:
    # Issue 34: the form showed bare n_layer, n_head, n_embd.
    from tests.factories import logged_in, make_organizer

    html = logged_in(make_organizer("olga")).get("/campaigns/new").content.decode()

    assert "Transformer blocks (n_layer)" in html and "Attention heads per block (n_head)" in html
    assert "Embedding width (n_embd)" in html

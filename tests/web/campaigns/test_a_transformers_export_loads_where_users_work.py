"""A language model's export is a folder that transformers' AutoModelForCausalLM and AutoTokenizer load and generate
with; its logits are the aggregators' parameters'. An image model's loads with AutoModelForImageClassification."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from django.test import Client
from django.urls import reverse

from crowdtrain.campaigns import validation
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.sharding import create_text_dataset
from crowdtrain.campaigns.tasks import compute_validation_loss
from crowdtrain_agent.models import get_model, model_from_flat
from crowdtrain_agent.models.hf import pixels
from tests.factories import logged_in, make_campaign, make_organizer

pytestmark = pytest.mark.django_db

SAMPLE_LEN = 17
TEXT = b"the quick brown fox jumps over the lazy dog. " * 40
LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "block_size": 16}  # fmt: skip


def _trained(c: Campaign, version: int) -> torch.Tensor:
    """What the aggregators would serve: the seeded init moved by the version, so it is not the init."""
    model = get_model(c.architecture).build(c.model_config, seed=c.seed)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return flat + version * 1e-2 * torch.sin(torch.arange(flat.numel(), dtype=torch.float32))


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Campaign:
    monkeypatch.setattr(validation, "fetch_campaign_params", _trained)
    dataset = create_text_dataset("fox", TEXT, SAMPLE_LEN, shard_bytes=16 * SAMPLE_LEN, validation_fraction=0.25)
    c = make_campaign(dataset, architecture="llama", model_config=LLAMA, seed=3)
    c.owner = make_organizer("owner")
    c.save(update_fields=["owner"])
    compute_validation_loss(c.pk, 10)
    return c


def _unzip(client: Client, campaign: Campaign, version: int, into: Path) -> Path:
    response = client.get(reverse("campaign-export-transformers", args=[campaign.pk]), {"version": version})
    assert response.status_code == 200, getattr(response, "content", b"")[:300]
    zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content))).extractall(into)
    return into / "model"


def test_the_export_loads_with_from_pretrained_and_gives_the_aggregators_logits(
    llama: Campaign, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _unzip(logged_in(llama.owner), llama, 10, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ours = model_from_flat("llama", llama.model_config, _trained(llama, 10)).eval()

    ids = tokenizer("the lazy fox", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(model(input_ids=ids).logits, ours(input_ids=ids).logits)
    assert ids[0].tolist() == list(b"the lazy fox")  # the campaign's samples were these bytes
    more = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert more.shape == (1, ids.shape[1] + 5)
    assert tokenizer.decode(more[0]).startswith("the lazy fox")


def test_an_image_model_loads_as_an_image_classifier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers import AutoModelForImageClassification

    monkeypatch.setattr(validation, "fetch_campaign_params", _trained)
    campaign = _image_campaign()
    compute_validation_loss(campaign.pk, 5)

    folder = _unzip(logged_in(campaign.owner), campaign, 5, tmp_path)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    ours = model_from_flat("resnet", campaign.model_config, _trained(campaign, 5)).eval()

    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    torch.testing.assert_close(model(pixel_values=pixels(images)).logits, ours(pixel_values=pixels(images)).logits)


def test_a_model_of_our_own_registry_says_to_use_the_two_files(llama: Campaign) -> None:
    Campaign.objects.filter(pk=llama.pk).update(architecture="gpt")  # as if it were the byte-level demo GPT

    response = logged_in(llama.owner).get(reverse("campaign-export-transformers", args=[llama.pk]), {"version": 10})

    assert response.status_code == 409
    assert "load them with crowdtrain_agent.models.load_exported" in response.json()["error"]


def test_only_the_owner_and_staff_get_the_folder(llama: Campaign) -> None:
    stranger = logged_in(make_organizer("otto"))

    response = stranger.get(reverse("campaign-export-transformers", args=[llama.pk]), {"version": 10})

    assert response.status_code == 404


def _image_campaign() -> Campaign:
    import numpy as np

    from crowdtrain.campaigns.sharding import create_tensor_dataset

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 3, 16, 16)).astype(np.uint8)
    y = rng.integers(0, 5, 40).astype(np.int64)
    dataset = create_tensor_dataset("images", x, y, validation_fraction=0.25)
    config: dict[str, Any] = {"image_size": 16, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
                              "num_labels": 5}  # fmt: skip
    c = make_campaign(dataset, architecture="resnet", model_config=config, seed=3)
    c.owner = make_organizer("owner")
    c.save(update_fields=["owner"])
    return c

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
from crowdtrain.campaigns.tasks import compute_validation_loss
from crowdtrain.datasets.sharding import create_text_dataset
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
    assert model.config.id2label == dict(enumerate(["ant", "bee", "cat", "dog", "eel"]))


def test_an_image_export_brings_a_processor_that_scales_pixels_as_training_did(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    monkeypatch.setattr(validation, "fetch_campaign_params", _trained)
    campaign = _image_campaign()
    compute_validation_loss(campaign.pk, 5)
    folder = _unzip(logged_in(campaign.owner), campaign, 5, tmp_path)
    picture = np.random.default_rng(1).integers(0, 256, (16, 16, 3)).astype(np.uint8)

    processed = AutoImageProcessor.from_pretrained(folder)(images=Image.fromarray(picture), return_tensors="pt")

    stored = torch.from_numpy(picture.transpose(2, 0, 1).copy())  # as an upload stores a 16 x 16 image
    torch.testing.assert_close(processed["pixel_values"][0], pixels(stored), atol=1e-5, rtol=0)


def test_a_language_model_on_a_tokenized_dataset_exports_that_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crowdtrain.datasets import tokenizing
    from crowdtrain.datasets.models import Dataset, Upload
    from crowdtrain.datasets.uploads import append_chunk, complete_upload, store_uploaded_tokenizer

    monkeypatch.setattr(validation, "fetch_campaign_params", _trained)
    trained = tokenizing.train_bpe([TEXT.decode()], 300)
    sha = store_uploaded_tokenizer(tokenizing.tokenizer_bytes(trained))["sha256"]
    owner = make_organizer("owner")
    upload = Upload.objects.create(owner=owner, name="fox", filename="fox.txt", size=len(TEXT), format="text",
                                   sample_len=SAMPLE_LEN, tokenizer=sha)  # fmt: skip
    upload = complete_upload(append_chunk(upload, 0, TEXT))
    dataset = Dataset.objects.get(pk=upload.dataset_id)
    assert dataset.status == "ready", dataset.error
    campaign = make_campaign(dataset, architecture="llama", model_config={**LLAMA, "vocab_size": 300}, seed=3)
    Campaign.objects.filter(pk=campaign.pk).update(owner=owner)
    compute_validation_loss(campaign.pk, 4)

    folder = _unzip(logged_in(owner), campaign, 4, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    ids = tokenizer("the lazy fox jumps", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == trained.encode("the lazy fox jumps").ids
    assert tokenizer.eos_token == tokenizing.END_OF_TEXT
    ours = model_from_flat("llama", campaign.model_config, _trained(campaign, 4)).eval()
    torch.testing.assert_close(model(input_ids=ids).logits, ours(input_ids=ids).logits)
    assert tokenizer.decode(model.generate(ids, max_new_tokens=3, do_sample=False)[0]).startswith("the lazy fox jumps")


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

    from crowdtrain.datasets.sharding import create_tensor_dataset

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 3, 16, 16)).astype(np.uint8)
    y = rng.integers(0, 5, 40).astype(np.int64)
    dataset = create_tensor_dataset("images", x, y, validation_fraction=0.25)
    dataset.image_size, dataset.labels = 16, ["ant", "bee", "cat", "dog", "eel"]  # as an image upload names them
    dataset.save(update_fields=["image_size", "labels"])
    config: dict[str, Any] = {"image_size": 16, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
                              "num_labels": 5}  # fmt: skip
    c = make_campaign(dataset, architecture="resnet", model_config=config, seed=3)
    c.owner = make_organizer("owner")
    c.save(update_fields=["owner"])
    return c

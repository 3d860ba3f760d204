"""A zipped transformers folder becomes a registry model and one flat fp32 vector of its weights.

The folders are written by the library itself (``save_pretrained``), as an
organizer's would be; what is stored must be the library model's parameters
in the order agents load them, and anything the registry would build
differently must be refused by name.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from crowdtrain.datasets import pretrained
from crowdtrain.datasets.models import Pretrained, Upload
from crowdtrain.datasets.pretrained import PretrainedError
from crowdtrain.datasets.uploads import append_chunk, complete_upload
from crowdtrain_agent.models import get_model, model_from_flat
from crowdtrain_agent.models.hf import library, pixels
from tests.factories import make_organizer

pytestmark = pytest.mark.django_db


def _saved(model: Any, folder: Path, **files: bytes) -> bytes:
    """``model.save_pretrained`` zipped in a folder of its own, as an organizer zips it."""
    model.save_pretrained(folder / "my-model")
    for name, data in files.items():
        (folder / "my-model" / name).write_bytes(data)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for path in sorted((folder / "my-model").iterdir()):
            archive.write(path, f"my-model/{path.name}")
    return out.getvalue()


def _llama(**overrides: Any) -> Any:
    torch.manual_seed(0)
    config = library("LlamaConfig")(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    rms_norm_eps=1e-5, **overrides)  # fmt: skip
    return library("LlamaForCausalLM")(config)


def _convert(data: bytes) -> pretrained.Converted:
    return pretrained.convert(io.BytesIO(data), lambda fraction: None)


def test_a_llama_folder_becomes_its_registry_config_and_its_parameters_in_flat_order(tmp_path: Path) -> None:
    model = _llama()

    converted = _convert(_saved(model, tmp_path))

    assert converted.architecture == "llama"
    assert converted.config["hidden_size"] == 32 and converted.config["rms_norm_eps"] == 1e-5
    assert converted.config["block_size"] == 64 and converted.config["vocab_size"] == 300
    expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(pretrained.flat_weights(converted.weights_sha256), expected)
    ours = model_from_flat("llama", converted.config, expected).eval()
    ids = torch.randint(0, 300, (2, 10))
    torch.testing.assert_close(ours(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_bf16_gpt2_saved_by_the_bare_model_loads_under_the_lm_head_names(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = library("GPT2Config")(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=48)
    lm = library("GPT2LMHeadModel")(config).to(torch.bfloat16)

    converted = _convert(_saved(lm.transformer, tmp_path))  # GPT-2's hub checkpoint has no "transformer." prefix

    assert converted.architecture == "gpt2" and converted.config["n_positions"] == 48
    expected = torch.nn.utils.parameters_to_vector(lm.parameters()).detach().float()
    assert torch.equal(pretrained.flat_weights(converted.weights_sha256), expected)


def test_a_resnets_batch_statistics_are_folded_into_its_frozen_norms(tmp_path: Path) -> None:
    torch.manual_seed(2)
    config = library("ResNetConfig")(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                     num_labels=3)  # fmt: skip
    model = library("ResNetForImageClassification")(config)
    model.train()
    with torch.no_grad():  # give the batch norms statistics of their own, as pretraining would
        for _ in range(3):
            model(pixel_values=torch.randn(8, 3, 32, 32) * 2 + 0.5)
    model.eval()

    converted = _convert(_saved(model, tmp_path))

    ours = model_from_flat("resnet", {**converted.config, "image_size": 32},
                           pretrained.flat_weights(converted.weights_sha256)).eval()  # fmt: skip
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    torch.testing.assert_close(ours(pixel_values=pixels(images)).logits, model(pixel_values=pixels(images)).logits,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_a_tokenizer_beside_the_weights_is_stored_and_named(tmp_path: Path) -> None:
    from crowdtrain.datasets import tokenizing

    tokenizer = tokenizing.tokenizer_bytes(tokenizing.train_bpe(["hello world " * 50], 300))

    converted = _convert(_saved(_llama(), tmp_path, **{"tokenizer.json": tokenizer}))

    assert (
        converted.tokenizer_sha256 and converted.tokenizer_sha256 == __import__("hashlib").sha256(tokenizer).hexdigest()
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda c: {**c, "model_type": "mistral"}, "model_type is 'mistral'; this platform builds gpt2, llama"),
        (lambda c: {**c, "hidden_act": "gelu"}, 'config.json sets hidden_act = "gelu"'),
        (lambda c: {**c, "rope_scaling": {"type": "linear", "factor": 2.0}}, "scales RoPE"),
        (lambda c: {**c, "hidden_size": 33}, "hidden_size (33) must be divisible by num_attention_heads"),
        (lambda c: {**c, "intermediate_size": 96}, "tensor model.layers.0.mlp.gate_proj.weight is [64, 32]"),
        (lambda c: {**c, "id2label": {"cat": "a cat"}}, "config.json holds a value of the wrong type"),
        (lambda c: {**c, "rope_parameters": ["not", "a", "dict"]}, "config.json holds a value of the wrong type"),
    ],
    ids=["family", "activation", "rope-scaling", "bounds", "shapes", "label-ids", "rope-type"],
)
def test_a_folder_the_registry_would_build_otherwise_is_refused_by_name(
    tmp_path: Path, change: Any, problem: str
) -> None:
    data = _saved(_llama(), tmp_path)
    edited = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(edited, "w") as target:
        for name in source.namelist():
            body = source.read(name)
            if name.endswith("config.json"):
                body = json.dumps(change(json.loads(body))).encode()
            target.writestr(name, body)

    with pytest.raises(PretrainedError, match=problem.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _convert(edited.getvalue())


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"weights/model.safetensors": b"x"}, "holds no config.json"),
        ({"m/config.json": b"{not json"}, "config.json is not valid JSON"),
        (
            {"m/config.json": json.dumps({"model_type": "llama"}).encode(), "m/pytorch_model.bin": b"pickle"},
            ".bin pickles are never loaded",
        ),
        (
            {"m/config.json": json.dumps({"model_type": "llama"}).encode(), "m/model.safetensors": b"\x00" * 16},
            "is not a safetensors file",
        ),
    ],
    ids=["no-config", "bad-json", "pickle-only", "bad-safetensors"],
)
def test_a_broken_folder_is_refused_with_what_to_do(files: dict[str, bytes], problem: str) -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)

    with pytest.raises(PretrainedError, match=problem):
        _convert(out.getvalue())


def test_an_upload_of_pretrained_weights_becomes_a_ready_record(tmp_path: Path) -> None:
    data = _saved(_llama(), tmp_path)
    upload = Upload.objects.create(owner=make_organizer("olga"), name="tiny llama", filename="llama.zip",
                                   size=len(data), format="pretrained")  # fmt: skip
    for offset in range(0, len(data), 1 << 16):
        upload = append_chunk(upload, offset, data[offset : offset + (1 << 16)])

    weights = Pretrained.objects.get(pk=complete_upload(upload).pretrained_id)

    assert weights.status == "ready", weights.error
    assert (weights.architecture, weights.param_count) == (
        "llama",
        get_model("llama").param_count(weights.model_config),
    )
    assert not upload.chunks.exists()


def test_a_refused_upload_says_why_on_its_record(tmp_path: Path) -> None:
    data = b"not a zip at all"
    upload = Upload.objects.create(owner=make_organizer("olga"), name="junk", filename="junk.zip", size=len(data),
                                   format="pretrained")  # fmt: skip
    upload = append_chunk(upload, 0, data)

    weights = Pretrained.objects.get(pk=complete_upload(upload).pretrained_id)

    assert weights.status == "failed" and "not a .zip file" in weights.error


# ------------------------------------------------------------------ campaigns that start from them


def _ready(tmp_path: Path, owner: Any, model: Any = None, **files: bytes) -> Pretrained:
    converted = _convert(_saved(model or _llama(), tmp_path, **files))
    return Pretrained.objects.create(name="tiny llama", owner=owner, **pretrained.record_fields(converted))


def _text(sample_len: int = 33) -> Any:
    from crowdtrain.datasets.sharding import create_text_dataset

    return create_text_dataset("bytes", b"hello pretrained world " * 400, sample_len)


def test_a_campaign_keeps_the_weights_model_and_may_shorten_a_rope_context(tmp_path: Path) -> None:
    from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign

    owner = make_organizer("olga")
    weights = _ready(tmp_path, owner)
    config = {**weights.model_config, "block_size": 32}

    campaign = create_campaign(name="c", owner=owner, dataset=_text(), architecture="llama", model_config=config,
                               pretrained=weights)  # fmt: skip

    assert campaign.pretrained == weights and campaign.model_config["block_size"] == 32
    with pytest.raises(CampaignConfigError, match="llama.hidden_size is 64, but the pretrained weights have 32"):
        create_campaign(name="c", owner=owner, dataset=_text(), architecture="llama",
                        model_config={**config, "hidden_size": 64}, pretrained=weights)  # fmt: skip
    with pytest.raises(CampaignConfigError, match="the pretrained weights are a llama; choose that architecture"):
        create_campaign(name="c", owner=owner, dataset=_text(), architecture="gpt2",
                        model_config={"block_size": 32}, pretrained=weights)  # fmt: skip


def test_a_campaign_on_weights_with_a_tokenizer_needs_a_dataset_of_its_ids(tmp_path: Path) -> None:
    from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
    from crowdtrain.datasets import tokenizing

    owner = make_organizer("olga")
    tokenizer = tokenizing.tokenizer_bytes(tokenizing.train_bpe(["hello world " * 50], 300))
    weights = _ready(tmp_path, owner, **{"tokenizer.json": tokenizer})

    with pytest.raises(CampaignConfigError, match="was not tokenized with the pretrained weights' tokenizer"):
        create_campaign(name="c", owner=owner, dataset=_text(), architecture="llama",
                        model_config={**weights.model_config, "block_size": 32}, pretrained=weights)  # fmt: skip


def test_the_assignment_names_the_weights_and_an_older_aggregator_never_gets_it(tmp_path: Path) -> None:
    from crowdtrain.campaigns.setup import create_campaign
    from crowdtrain.scheduler.backbone import _assign_message
    from crowdtrain.scheduler.models import SliceAssignment
    from crowdtrain_agent.protocol.schema import lost_in
    from tests.factories import make_aggregator

    owner = make_organizer("olga")
    weights = _ready(tmp_path, owner)
    campaign = create_campaign(name="c", owner=owner, dataset=_text(), architecture="llama",
                               model_config={**weights.model_config, "block_size": 32}, pretrained=weights)  # fmt: skip
    row = SliceAssignment.objects.create(campaign=campaign, aggregator=make_aggregator(), index=0, start=0,
                                         end=campaign.param_count)  # fmt: skip

    message = _assign_message(row, campaign, 0)

    assert message.initial == weights.weights_sha256
    assert lost_in(message, 5) == ["initial"] and lost_in(message, 6) == []


def test_only_an_aggregator_holding_a_slice_of_such_a_campaign_downloads_the_weights(tmp_path: Path) -> None:
    from django.test import Client

    from crowdtrain.accounts.tokens import hash_token
    from crowdtrain.campaigns.setup import create_campaign
    from crowdtrain.scheduler.models import Aggregator, SliceAssignment

    owner = make_organizer("olga")
    weights = _ready(tmp_path, owner)
    campaign = create_campaign(name="c", owner=owner, dataset=_text(), architecture="llama",
                               model_config={**weights.model_config, "block_size": 32}, pretrained=weights)  # fmt: skip
    holder = Aggregator.objects.create(name="holder", token_hash=hash_token("ctb_holder"))
    Aggregator.objects.create(name="other", token_hash=hash_token("ctb_other"))
    SliceAssignment.objects.create(campaign=campaign, aggregator=holder, index=0, start=0, end=campaign.param_count)
    url = f"/api/backbone/weights/{weights.weights_sha256}"

    def get(token: str) -> Any:
        return Client().get(url, headers={"Authorization": f"Bearer {token}"})

    answer = get("ctb_holder")
    assert answer.status_code == 200
    body = b"".join(answer.streaming_content)
    assert torch.equal(
        torch.frombuffer(bytearray(body), dtype=torch.float32), pretrained.flat_weights(weights.weights_sha256)
    )
    assert get("ctb_other").status_code == 404
    assert get("ctb_nobody").status_code == 401


def test_an_aggregator_keeps_its_slice_of_the_weights_only_if_every_byte_hashes_right() -> None:
    from crowdtrain_agent.protocol import ModelSpec, OptimizerSpec, SliceAssignment
    from crowdtrain_backbone.slices import PretrainedUnavailable, initial_params

    flat = torch.randn(1000)
    body = flat.numpy().astype("<f4").tobytes()
    sha = hashlib.sha256(body).hexdigest()

    def assignment(**fields: Any) -> SliceAssignment:
        values = dict(campaign_id=1, slice_index=1, start=300, end=700, param_count=1000,
                      model=ModelSpec(architecture="mlp", config={}), optimizer=OptimizerSpec(name="sgd", lr=0.1),
                      seed=0, version=0, staleness=0, checkpoint_every=10, max_grad_norm=0.0, initial=sha)  # fmt: skip
        return SliceAssignment(**{**values, **fields})

    assert torch.equal(initial_params(assignment(), lambda s: io.BytesIO(body)), flat[300:700])
    with pytest.raises(PretrainedUnavailable, match="hash to"):
        initial_params(assignment(), lambda s: io.BytesIO(body[:-4] + b"\0\0\0\0"))
    with pytest.raises(PretrainedUnavailable, match="3996 bytes came, 4000 expected"):
        initial_params(assignment(), lambda s: io.BytesIO(body[:-4]))

    def unreachable(sha: str) -> Any:
        raise OSError("connection refused")

    with pytest.raises(PretrainedUnavailable, match="cannot download them: connection refused"):
        initial_params(assignment(), unreachable)


def test_an_image_classifier_for_other_classes_keeps_the_body_and_gets_a_seeded_head(tmp_path: Path) -> None:
    from crowdtrain.campaigns.lifecycle import apply_move
    from crowdtrain.campaigns.setup import create_campaign
    from tests.web.campaigns.test_an_image_archive_becomes_image_shards import _files, _upload, _zip

    torch.manual_seed(4)
    config = library("ResNetConfig")(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                     num_labels=5)  # fmt: skip
    model = library("ResNetForImageClassification")(config)  # "pretrained" on 5 classes
    owner = make_organizer("olga")
    weights = _ready(tmp_path, owner, model=model)
    dataset = _upload(_zip(_files()))  # 3 classes of 16 x 16 images
    ours = {**weights.model_config, "image_size": 16, "num_labels": 3}

    campaign = create_campaign(name="c", owner=owner, dataset=dataset, architecture="resnet", model_config=ours,
                               pretrained=weights, seed=9)  # fmt: skip
    campaign = apply_move(campaign.pk, "start", owner)

    assert campaign.initial_weights and campaign.initial_weights != weights.weights_sha256
    start = pretrained.flat_weights(campaign.initial_weights)
    loaded = model_from_flat("resnet", ours, start)
    theirs = dict(model.named_parameters())
    seeded = dict(get_model("resnet").build(ours, seed=9).named_parameters())
    for name, parameter in loaded.named_parameters():
        expected = seeded[name] if name.startswith("classifier") else theirs[name]
        assert torch.equal(parameter, expected), name


def test_weights_that_would_unpack_past_the_models_size_are_refused_unread(tmp_path: Path) -> None:
    config = _saved(_llama(), tmp_path)
    with zipfile.ZipFile(io.BytesIO(config)) as source:
        config_json = source.read("my-model/config.json")
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("m/config.json", config_json)
        archive.writestr("m/model.safetensors", b"\0" * (48 << 20))  # 48 MiB of zeros: ~50 KB in the zip
    assert len(bomb.getvalue()) < 1 << 20

    with pytest.raises(PretrainedError, match="unpack to 50,331,648 bytes, more than the"):
        _convert(bomb.getvalue())


@pytest.mark.django_db(transaction=True)
def test_starting_prepares_the_weights_before_the_campaign_is_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seconds of reading and writing weights inside the start's transaction held every other writer of
    # the embedded database (lease records, heartbeats) back for as long.
    from django.db import connection

    from crowdtrain.campaigns import setup
    from crowdtrain.campaigns.lifecycle import apply_move
    from crowdtrain.campaigns.setup import create_campaign
    from tests.web.campaigns.test_an_image_archive_becomes_image_shards import _files, _upload, _zip

    config = library("ResNetConfig")(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                                     num_labels=5)  # fmt: skip
    owner = make_organizer("olga")
    weights = _ready(tmp_path, owner, model=library("ResNetForImageClassification")(config))
    ours = {**weights.model_config, "image_size": 16, "num_labels": 3}
    campaign = create_campaign(name="c", owner=owner, dataset=_upload(_zip(_files())), architecture="resnet",
                               model_config=ours, pretrained=weights, seed=9)  # fmt: skip
    in_transaction: list[bool] = []
    made = setup.campaign_weights

    def watched(*args: Any) -> str:
        in_transaction.append(connection.in_atomic_block)
        return made(*args)

    monkeypatch.setattr(setup, "campaign_weights", watched)

    started = apply_move(campaign.pk, "start", owner)

    assert in_transaction == [False]
    assert started.state == "running" and started.initial_weights not in ("", weights.weights_sha256)


@pytest.mark.django_db
def test_a_start_refused_for_its_dataset_reads_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The weights took seconds to read before the refusal, and an unreadable file hid the real problem.
    from crowdtrain.campaigns import setup
    from crowdtrain.campaigns.lifecycle import LifecycleError, apply_move
    from crowdtrain.campaigns.setup import create_campaign
    from crowdtrain.datasets.models import Dataset

    owner = make_organizer("omar")
    weights = _ready(tmp_path, owner)
    dataset = _text(weights.model_config["block_size"] + 1)
    campaign = create_campaign(name="c", owner=owner, dataset=dataset, architecture="llama",
                               model_config=weights.model_config, pretrained=weights)  # fmt: skip
    Dataset.objects.filter(pk=campaign.dataset_id).update(status=Dataset.Status.SHARDING)
    read: list[object] = []
    monkeypatch.setattr(setup, "campaign_weights", lambda *args: read.append(args) or "")

    with pytest.raises(LifecycleError, match="is not ready yet"):
        apply_move(campaign.pk, "start", owner)

    assert read == []

"""Text uploads tokenized at upload time: a trained BPE or the organizer's tokenizer.json, ids in shards.

The ids in the shards must be the tokenizer's encoding of the text, the
dataset must name the tokenizer it was made with, agents must get that file
from the shard endpoint, and a campaign's model must embed every id.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from django.core.files.storage import default_storage
from django.test import Client
from tokenizers import Tokenizer

from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from crowdtrain.datasets import tokenizing
from crowdtrain.datasets.models import Dataset, Upload, shard_storage_name
from crowdtrain.datasets.sharding import stdlib_corpus
from crowdtrain.datasets.uploads import append_chunk, complete_upload
from crowdtrain_agent.data import ShardReader
from tests.factories import logged_in, make_device, make_organizer

# Without a test transaction: the tokenizer library reads the texts (and reports progress) from its own thread.
pytestmark = pytest.mark.django_db(transaction=True)

CORPUS = stdlib_corpus(200_000)


@pytest.fixture(autouse=True)
def small_shards(settings: Any) -> None:
    settings.CROWDTRAIN_VALIDATION_FRACTION = 0.05
    settings.CROWDTRAIN_SHARD_BYTES = 4096


@pytest.fixture
def olga() -> Any:
    return make_organizer("olga")


def _upload(owner: Any, data: bytes, fmt: str = "text", **fields: Any) -> Dataset:
    upload = Upload.objects.create(
        owner=owner, name="d", filename=f"d.{fmt}", size=len(data), format=fmt, sample_len=33, **fields
    )
    for offset in range(0, len(data), 1 << 16):
        upload = append_chunk(upload, offset, data[offset : offset + (1 << 16)])
    return Dataset.objects.get(pk=complete_upload(upload).dataset_id)


def _ids(dataset: Dataset, split: str = "train") -> np.ndarray:
    shards = dataset.train_shards() if split == "train" else dataset.validation_shards()
    spec = dataset.data_spec()
    rows = [ShardReader(spec, default_storage.open(s.storage_name).read()) for s in shards]
    return np.concatenate([np.asarray(r._rows) for r in rows])


def _tokenizer_of(dataset: Dataset) -> Tokenizer:
    return Tokenizer.from_str(default_storage.open(shard_storage_name(dataset.tokenizer_sha256)).read().decode())


def test_a_tokenizer_trained_on_the_upload_makes_shards_of_its_own_ids(olga: Any) -> None:
    dataset = _upload(olga, CORPUS, tokenizer="train", vocab_size=600)

    assert dataset.status == "ready", dataset.error
    assert (dataset.kind, dataset.vocab_size, dataset.token_bytes) == ("tokens", 600, 2)
    tokenizer = _tokenizer_of(dataset)
    expected = tokenizer.encode(CORPUS.decode(), add_special_tokens=False).ids
    ids = np.concatenate([_ids(dataset), _ids(dataset, "validation")])
    # The whole samples of the text's ids, in order; the ragged tail is dropped.
    assert ids.tolist() == expected[: len(ids)] and len(expected) - len(ids) < 33
    assert dataset.num_samples + dataset.num_validation_samples == len(expected) // 33
    assert tokenizer.decode(ids[:200].tolist()) == tokenizer.decode(expected[:200])


def test_an_uploaded_tokenizer_json_is_used_as_it_is(olga: Any) -> None:
    trained = tokenizing.train_bpe([CORPUS.decode()], 300)
    client = logged_in(olga)
    answer = client.post("/datasets/tokenizers", tokenizing.tokenizer_bytes(trained), content_type="application/json")
    assert answer.status_code == 201 and answer.json()["vocab_size"] == 300

    dataset = _upload(olga, CORPUS, tokenizer=answer.json()["sha256"])

    assert dataset.status == "ready" and dataset.tokenizer_sha256 == answer.json()["sha256"]
    assert _ids(dataset)[:100].tolist() == trained.encode(CORPUS.decode()).ids[:100]


def test_json_lines_are_separate_documents_joined_by_the_end_of_text_token(olga: Any) -> None:
    texts = [CORPUS[i : i + 3000].decode() for i in range(0, 60_000, 3000)]
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()

    dataset = _upload(olga, data, fmt="jsonl", tokenizer="train", vocab_size=400, text_field="text")

    tokenizer = _tokenizer_of(dataset)
    end = tokenizer.token_to_id(tokenizing.END_OF_TEXT)
    ids = _ids(dataset).tolist()
    first = tokenizer.encode(texts[0], add_special_tokens=False).ids
    assert ids[: len(first) + 1] == [*first, end]
    assert ids.count(end) >= len(texts) - 3  # the held-out tail and the ragged end take the last few


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"hello " * 100 + b"\xff\xfe" + b"world " * 100, "byte 600 is not UTF-8"),
        (b"hello " * 100 + b"\x00", "byte 600 is a NUL byte"),
        (b"tiny", "shorter than one sample of 33 tokens"),
    ],
)
def test_a_text_a_tokenizer_cannot_read_fails_with_what_is_wrong(olga: Any, data: bytes, problem: str) -> None:
    dataset = _upload(olga, data, tokenizer="train", vocab_size=300)

    assert dataset.status == "failed"
    assert problem in dataset.error
    assert not dataset.shards.exists()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"", "empty"),
        (b'{"not": "a tokenizer"}', "not a tokenizer.json"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 100_000, "not a tokenizer.json"),
    ],
)
def test_a_bad_tokenizer_file_is_refused_with_a_message(olga: Any, body: bytes, problem: str) -> None:
    answer = logged_in(olga).post("/datasets/tokenizers", body, content_type="application/json")

    assert answer.status_code == 400
    assert problem in answer.json()["error"]


def test_only_organizers_upload_tokenizers(client: Client) -> None:
    assert client.post("/datasets/tokenizers", b"{}", content_type="application/json").status_code == 401


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"tokenizer": "0" * 64}, "no tokenizer 000000000000"),
        ({"tokenizer": "bpe"}, "tokenizer must be empty"),
        ({"tokenizer": "train", "vocab_size": 100}, "vocab_size must be between 257"),
        ({"tokenizer": "train", "vocab_size": "big"}, "vocab_size must be an integer"),
    ],
)
def test_an_upload_naming_a_bad_tokenizer_is_refused_before_any_byte(olga: Any, fields: dict, problem: str) -> None:
    body = {"filename": "c.txt", "size": 100, "format": "text", "sample_len": 33, **fields}

    answer = logged_in(olga).post("/datasets/uploads", json.dumps(body), content_type="application/json")

    assert answer.status_code == 400
    assert problem in answer.json()["error"]


def test_a_shard_cannot_be_named_as_a_tokenizer(olga: Any) -> None:
    from tests.factories import make_text_dataset

    shard = make_text_dataset().shards.first()
    body = {"filename": "c.txt", "size": 100, "format": "text", "sample_len": 33, "tokenizer": shard.sha256}

    answer = logged_in(olga).post("/datasets/uploads", json.dumps(body), content_type="application/json")

    assert answer.status_code == 400 and "is not a tokenizer uploaded here" in answer.json()["error"]


def test_agents_fetch_the_tokenizer_beside_the_shards(olga: Any) -> None:
    dataset = _upload(olga, CORPUS, tokenizer="train", vocab_size=300)
    _, token = make_device()

    answer = Client().get(f"/api/shards/{dataset.tokenizer_sha256}", headers={"Authorization": f"Bearer {token}"})

    assert answer.status_code == 200
    assert b"".join(answer.streaming_content) == tokenizing.tokenizer_bytes(_tokenizer_of(dataset))


def test_a_campaign_model_must_embed_every_id(olga: Any) -> None:
    dataset = _upload(olga, CORPUS, tokenizer="train", vocab_size=600)
    llama = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "block_size": 32}  # fmt: skip

    with pytest.raises(CampaignConfigError, match="vocab_size is 256 but the dataset's tokenizer has 600 tokens"):
        create_campaign(name="c", owner=olga, dataset=dataset, architecture="llama", model_config=llama)
    with pytest.raises(CampaignConfigError, match="gpt reads bytes and cannot train on a tokenized dataset"):
        create_campaign(name="c", owner=olga, dataset=dataset, architecture="gpt",
                        model_config={"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 32})  # fmt: skip
    campaign = create_campaign(
        name="c", owner=olga, dataset=dataset, architecture="llama", model_config={**llama, "vocab_size": 600}
    )

    assert campaign.dataset.data_spec().tokenizer == dataset.tokenizer_sha256

from __future__ import annotations

import io

import numpy as np
import pytest
from django.core.files.storage import default_storage

from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from crowdtrain.datasets.models import Shard
from crowdtrain.datasets.sharding import DatasetError, create_npz_dataset, create_text_dataset, stdlib_corpus
from tests.factories import TINY_GPT, make_text_dataset, make_user

pytestmark = pytest.mark.django_db


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_a_text_corpus_becomes_contiguous_content_addressed_shards() -> None:
    dataset = create_text_dataset("t", b"0123456789" * 100, sample_len=10, shard_bytes=300)

    shards = list(dataset.shards.all())

    assert dataset.num_samples == 100
    assert [s.num_samples for s in shards] == [30, 30, 30, 10]
    assert [s.first_sample for s in shards] == [0, 30, 60, 90]
    assert all(default_storage.exists(s.storage_name) for s in shards)


def test_identical_shards_are_stored_once() -> None:
    create_text_dataset("a", b"x" * 1000, sample_len=10, shard_bytes=100)
    create_text_dataset("b", b"x" * 1000, sample_len=10, shard_bytes=100)

    assert Shard.objects.count() == 20
    assert Shard.objects.values("sha256").distinct().count() == 1


def test_an_npz_with_x_and_y_becomes_a_tensor_dataset() -> None:
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)

    dataset = create_npz_dataset("n", _npz(x=x, y=np.arange(50) % 3), shard_bytes=400)

    assert dataset.kind == "tensors"
    assert dataset.num_samples == 50
    assert dataset.shards.count() > 1


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"PK\x03\x04 not really a zip", "not a readable .npz file"),
        (_npz(x=np.zeros((3, 2))), r"lacks array\(s\) y"),
        (_npz(x=np.zeros((3, 2)), y=np.zeros(4, dtype=np.int64)), "x has 3 rows but y has 4"),
        (_npz(x=np.array([[np.nan]]), y=np.zeros(1, dtype=np.int64)), "NaN or infinite"),
        (_npz(x=np.zeros((3, 2)), y=np.zeros(3)), "y integer class labels"),
        (_npz(x=np.zeros((0, 2)), y=np.zeros(0, dtype=np.int64)), "at least one row"),
    ],
)
def test_it_rejects_bad_npz_files_and_keeps_nothing(data: bytes, problem: str) -> None:
    with pytest.raises(DatasetError, match=problem):
        create_npz_dataset("bad", data)

    assert not Shard.objects.exists()


def test_it_rejects_text_shorter_than_one_sample() -> None:
    with pytest.raises(DatasetError, match="shorter than one sample"):
        create_text_dataset("short", b"abc", sample_len=10)


def test_the_demo_corpus_is_the_standard_library_in_a_fixed_order() -> None:
    first, again = stdlib_corpus(200_000), stdlib_corpus(200_000)

    assert first == again and len(first) == 200_000
    assert b"def " in first and b"import " in first


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"architecture": "gpt", "model_config": {**TINY_GPT, "block_size": 16}},
            "must equal the dataset's sample length 9",
        ),
        ({"architecture": "mlp", "model_config": {}}, "mlp trains on tensors data"),
        ({"architecture": "gpt", "model_config": TINY_GPT, "codec": "int3"}, r"codec\) must be one of fp32, fp16"),
        ({"architecture": "gpt", "model_config": TINY_GPT, "optimizer": {"name": "adam"}}, "unknown optimizer 'adam'"),
        ({"architecture": "gpt", "model_config": TINY_GPT, "optimizer": {"lr": -1}}, r"optimizer.lr\) must be above 0"),
        (
            {"architecture": "gpt", "model_config": TINY_GPT, "target_batch_size": 2, "microbatch_size": 4},
            "must not exceed",
        ),
    ],
)
def test_a_campaign_with_a_bad_setting_is_not_saved(fields: dict, problem: str) -> None:
    dataset = make_text_dataset()

    with pytest.raises(CampaignConfigError, match=problem):
        create_campaign(name="c", owner=make_user(), dataset=dataset, **fields)

    assert not dataset.campaigns.exists()

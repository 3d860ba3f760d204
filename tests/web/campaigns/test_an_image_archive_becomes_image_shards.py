"""Image uploads: class folders in a zip or tar, or a WebDataset tar, become shards of resized uint8 pixels.

Each class is painted its own colour, so a row's pixels say which label it
must carry whatever order the shuffle put it in.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from typing import Any

import numpy as np
import pytest
import torch
from django.contrib.auth import get_user_model
from django.core.files.storage import default_storage
from PIL import Image

from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign
from crowdtrain.datasets.models import Dataset, Upload
from crowdtrain.datasets.uploads import append_chunk, complete_upload
from crowdtrain_agent.data import ShardReader
from tests.factories import make_organizer, make_text_dataset

pytestmark = pytest.mark.django_db

COLOURS = {"cat": (250, 10, 10), "dog": (10, 10, 250), "fox": (10, 250, 10)}


@pytest.fixture(autouse=True)
def small_shards(settings: Any) -> None:
    settings.CROWDTRAIN_VALIDATION_FRACTION = 0.1
    settings.CROWDTRAIN_SHARD_BYTES = 8 * 3 * 16 * 16


def _image(colour: tuple[int, int, int], fmt: str = "PNG", size: tuple[int, int] = (40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def _files(per_class: int = 7) -> dict[str, bytes]:
    files = {}
    for name, colour in COLOURS.items():
        for i in range(per_class):
            fmt = "JPEG" if i % 2 else "PNG"
            files[f"photos/{name}/{i:03d}.{fmt.lower()}"] = _image(colour, fmt, (40 + i, 30))
    return files


def _zip(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


def _tar(files: dict[str, bytes], mode: str = "w:gz") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _olga() -> Any:
    return get_user_model().objects.filter(username="olga").first() or make_organizer("olga")


def _upload(data: bytes, **fields: Any) -> Dataset:
    upload = Upload.objects.create(
        owner=_olga(), name="pets", filename="pets.zip", size=len(data), format="images",
        image_size=fields.pop("image_size", 16), **fields,
    )  # fmt: skip
    for offset in range(0, len(data), 4096):
        upload = append_chunk(upload, offset, data[offset : offset + 4096])
    return Dataset.objects.get(pk=complete_upload(upload).dataset_id)


def _rows(dataset: Dataset, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    shards = dataset.train_shards() if split == "train" else dataset.validation_shards()
    parts = []
    for shard in shards:
        reader = ShardReader(dataset.data_spec(), default_storage.open(shard.storage_name).read())
        parts.append(reader.read(0, reader.count))
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _check_pixels_match_labels(dataset: Dataset, x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, dataset.image_size, dataset.image_size)
    for pixels, label in zip(x, y, strict=True):
        colour = COLOURS[dataset.labels[int(label)]]
        assert np.abs(pixels.float().mean(dim=(1, 2)).numpy() - colour).max() < 8  # JPEG is close, not exact


@pytest.mark.parametrize("pack", [_zip, _tar], ids=["zip", "tar.gz"])
def test_class_folders_become_labelled_resized_images_and_a_stray_file_is_named(pack: Any) -> None:
    files = _files()
    files["photos/cat/readme.txt"] = b"these are my cats"
    files["photos/dog/broken.jpg"] = b"\xff\xd8\xff not really a jpeg"
    files["__MACOSX/photos/._cat"] = b"resource fork"

    dataset = _upload(pack(files))

    assert dataset.status == "ready", dataset.error
    assert dataset.labels == ["cat", "dog", "fox"] and dataset.image_size == 16
    assert dataset.num_samples + dataset.num_validation_samples == 21
    assert dataset.skipped_count == 2
    assert {s["name"] for s in dataset.skipped} == {"photos/cat/readme.txt", "photos/dog/broken.jpg"}
    why = {s["name"]: s["why"] for s in dataset.skipped}
    assert why["photos/cat/readme.txt"].startswith("not an image (none of JPEG, PNG")
    assert why["photos/dog/broken.jpg"].startswith(("a damaged image", "not an image"))
    for split in ("train", "validation"):
        _check_pixels_match_labels(dataset, *_rows(dataset, split))


def test_the_samples_are_shuffled_so_a_step_holds_every_class() -> None:
    dataset = _upload(_zip(_files(per_class=10)))

    _, y = _rows(dataset)

    # Archive order is cat x10, dog x10, fox x10; the first eight samples of a shuffled order are not one class.
    assert len(set(y[:8].tolist())) > 1
    assert sorted(y.tolist() + _rows(dataset, "validation")[1].tolist()) == sorted([0] * 10 + [1] * 10 + [2] * 10)


def test_the_same_archive_gives_the_same_shards() -> None:
    data = _zip(_files())

    first, second = _upload(data), _upload(data)

    assert list(first.shards.values_list("sha256", flat=True)) == list(second.shards.values_list("sha256", flat=True))


def test_a_webdataset_tar_takes_its_labels_from_cls_files() -> None:
    files = {}
    for i in range(12):
        label = i % 3
        files[f"shard/{i:06d}.jpg"] = _image(list(COLOURS.values())[label], "JPEG")
        files[f"shard/{i:06d}.cls"] = str(label).encode()
    files["shard/000099.jpg"] = _image((0, 0, 0), "JPEG")  # no .cls: skipped, named

    dataset = _upload(_tar(files, "w"))

    assert dataset.status == "ready", dataset.error
    assert dataset.labels == ["0", "1", "2"]
    assert [s["name"] for s in dataset.skipped] == ["shard/000099.jpg"]
    x, y = _rows(dataset)
    for pixels, label in zip(x, y, strict=True):
        assert np.abs(pixels.float().mean(dim=(1, 2)).numpy() - list(COLOURS.values())[int(label)]).max() < 8


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"just some bytes, no archive", "not a .zip or .tar archive"),
        (_zip({"a/notes.txt": b"hello", "b/more.txt": b"world"}), "none of the archive's files is a usable image"),
        (_zip({"cat/1.png": _image((1, 2, 3)), "cat/2.png": _image((1, 2, 3))}), "of one class (cat)"),
        (_zip({"1.png": _image((1, 2, 3)), "2.png": _image((1, 2, 3))}), "none of the archive's files"),
    ],
    ids=["no-archive", "no-images", "one-class", "no-folders"],
)
def test_an_archive_without_two_classes_of_images_fails_with_the_reason(data: bytes, problem: str) -> None:
    dataset = _upload(data)

    assert dataset.status == "failed"
    assert problem in dataset.error
    assert not dataset.shards.exists()


def test_an_image_larger_than_the_pixel_limit_is_skipped_not_decoded(settings: Any) -> None:
    settings.CROWDTRAIN_MAX_IMAGE_PIXELS = 5000
    files = _files(per_class=2)
    files["photos/cat/huge.png"] = _image((250, 10, 10), "PNG", (200, 200))

    dataset = _upload(_zip(files))

    assert [s["name"] for s in dataset.skipped] == ["photos/cat/huge.png"]
    assert "over the limit of 5000" in dataset.skipped[0]["why"]


def test_a_campaign_on_images_needs_an_image_model_of_their_size_and_classes() -> None:
    dataset = _upload(_zip(_files()))
    owner = dataset.owner
    resnet = {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 16, "num_labels": 3}

    with pytest.raises(CampaignConfigError, match="image_size is 32, but the dataset's images are 16 x 16"):
        create_campaign(name="c", owner=owner, dataset=dataset, architecture="resnet",
                        model_config={**resnet, "image_size": 32})  # fmt: skip
    with pytest.raises(CampaignConfigError, match="num_labels is 2, but the dataset has 3 classes"):
        create_campaign(name="c", owner=owner, dataset=dataset, architecture="resnet",
                        model_config={**resnet, "num_labels": 2})  # fmt: skip
    with pytest.raises(CampaignConfigError, match="mlp does not read images"):
        create_campaign(name="c", owner=owner, dataset=dataset, architecture="mlp", model_config={"in_dim": 768})
    campaign = create_campaign(
        name="c", owner=owner, dataset=dataset, architecture="resnet", model_config=resnet, augmentation="flip_crop"
    )
    assert campaign.augmentation == "flip_crop"


def test_augmentation_is_refused_for_data_that_is_not_images() -> None:
    dataset = make_text_dataset()

    with pytest.raises(CampaignConfigError, match="holds no uploaded images; choose none"):
        create_campaign(name="c", owner=_olga(), dataset=dataset, architecture="gpt",
                        model_config={"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8},
                        augmentation="flip")  # fmt: skip


def test_a_member_the_archive_cannot_give_back_is_skipped_and_named() -> None:
    files = _files(per_class=3)
    data = bytearray(_zip(files))
    victim = b"photos/dog/001.jpeg"
    at = data.index(victim) + len(victim) + 40  # inside that member's stored bytes: its CRC no longer holds
    data[at] ^= 0xFF

    dataset = _upload(bytes(data))

    assert dataset.status == "ready", dataset.error
    assert [s["name"] for s in dataset.skipped] == ["photos/dog/001.jpeg"]
    assert "cannot be read from the archive" in dataset.skipped[0]["why"]


def test_a_webdataset_whose_samples_all_name_one_class_is_refused() -> None:
    files = {}
    for i in range(6):
        files[f"s/{i:04d}.png"] = _image((1, 2, 3))
        files[f"s/{i:04d}.cls"] = b"7"
    files["s/0099.cls"] = b"1" * 1000  # not a class id: a 1,000-byte file is skipped unread

    dataset = _upload(_tar(files, "w"))

    assert dataset.status == "failed" and "every readable image is of one class (7)" in dataset.error

"""Token shards and image augmentation as agents read them, and who may be sent them (protocol 2.6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain_agent.data import (
    ShardReader,
    augment_images,
    check_tokenizer,
    sample_seed,
    token_bytes_for,
    token_dtype,
)
from crowdtrain_agent.models import get_model
from crowdtrain_agent.models.registry import ModelConfigError
from crowdtrain_agent.protocol import DataSpec, ProtocolError, SampleRange
from crowdtrain_agent.protocol.schema import lost_in
from crowdtrain_agent.trainer import gather_samples


def _tokens(ids: list[int], width: int) -> bytes:
    return np.asarray(ids, dtype=token_dtype(width)).tobytes()


@given(
    ids=st.lists(st.integers(0, 70_000), min_size=0, max_size=200),
    sample_len=st.integers(2, 12),
)
def test_a_token_shard_reads_back_the_ids_as_shifted_inputs_and_targets(ids: list[int], sample_len: int) -> None:
    vocab = max(ids, default=0) + 1
    width = token_bytes_for(vocab)
    whole = ids[: len(ids) - len(ids) % sample_len]
    spec = DataSpec(kind="tokens", sample_len=sample_len, token_bytes=width, vocab_size=vocab)

    reader = ShardReader(spec, _tokens(whole, width))

    assert reader.count == len(whole) // sample_len
    if reader.count:
        x, y = reader.read(0, reader.count)
        rows = np.asarray(whole).reshape(-1, sample_len)
        assert x.tolist() == rows[:, :-1].tolist() and y.tolist() == rows[:, 1:].tolist()
        assert x.dtype == torch.int64


def test_an_id_outside_the_vocabulary_is_refused_with_where_it_is() -> None:
    spec = DataSpec(kind="tokens", sample_len=4, token_bytes=2, vocab_size=100)

    with pytest.raises(ProtocolError, match="token 5 of the shard is id 100, outside the vocabulary of 100"):
        ShardReader(spec, _tokens([1, 2, 3, 4, 5, 100, 7, 8], 2))


def test_a_token_shard_of_broken_samples_is_refused() -> None:
    spec = DataSpec(kind="tokens", sample_len=4, token_bytes=4, vocab_size=100)

    with pytest.raises(ProtocolError, match="not whole samples of 16 bytes"):
        ShardReader(spec, _tokens([1, 2, 3], 4))


def test_a_tokenizer_of_another_vocabulary_is_refused() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={chr(65 + i): i for i in range(20)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    data = tokenizer.to_str().encode()

    assert check_tokenizer(DataSpec(kind="tokens", sample_len=4, token_bytes=2, vocab_size=20, tokenizer="a" * 64),
                           data) == 20  # fmt: skip
    with pytest.raises(ProtocolError, match="has 20 tokens but the lease says 300"):
        check_tokenizer(DataSpec(kind="tokens", sample_len=4, token_bytes=2, vocab_size=300, tokenizer="a" * 64), data)
    with pytest.raises(ProtocolError, match="not a tokenizer.json"):
        check_tokenizer(DataSpec(kind="tokens", sample_len=4, vocab_size=20, tokenizer="a" * 64), b"{}")


def test_a_model_must_embed_the_datasets_ids() -> None:
    llama = get_model("llama")

    llama.check_vocab({"vocab_size": 1000}, 1000)
    with pytest.raises(ModelConfigError, match="vocab_size is 999 but the dataset's tokenizer has 1000 tokens"):
        llama.check_vocab({"vocab_size": 999}, 1000)
    with pytest.raises(ModelConfigError, match="gpt reads bytes"):
        get_model("gpt").check_vocab({}, 200)


def test_token_data_and_augmentation_are_never_sent_to_a_peer_older_than_2_6() -> None:
    tokens = DataSpec(kind="tokens", sample_len=9, token_bytes=2, vocab_size=500, tokenizer="b" * 64)
    flips = DataSpec(kind="tensors", augment="flip")

    assert "kind=tokens" in lost_in(tokens, 5) and "token_bytes" in lost_in(tokens, 5)
    assert lost_in(flips, 5) == ["augment"]
    assert lost_in(tokens, 6) == lost_in(flips, 6) == lost_in(DataSpec(kind="text", sample_len=9), 5) == []


# ------------------------------------------------------------------ augmentation

images = st.integers(1, 4).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(2, 12), st.lists(st.integers(0, 2**62), min_size=n, max_size=n))
)


@settings(max_examples=50)
@given(images=images, mode=st.sampled_from(["flip", "flip_crop"]))
def test_an_augmentation_depends_on_the_seed_alone(images: tuple, mode: str) -> None:
    n, side, seeds = images
    x = torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(side))

    once, again = augment_images(x, mode, seeds), augment_images(x.clone(), mode, seeds)

    assert torch.equal(once, again) and once.dtype == torch.uint8 and once.shape == x.shape
    for i in range(n):  # each image on its own gets what it got among others: no dependence on company
        assert torch.equal(augment_images(x[i : i + 1], mode, seeds[i : i + 1])[0], once[i])


@settings(max_examples=50)
@given(side=st.integers(2, 12), seed=st.integers(0, 2**62))
def test_a_flip_mirrors_or_keeps_the_image_and_loses_no_pixel(side: int, seed: int) -> None:
    x = torch.randint(0, 256, (1, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed % 99))

    out = augment_images(x, "flip", [seed])

    assert torch.equal(out, x) or torch.equal(out, x.flip(-1))


@settings(max_examples=50)
@given(side=st.integers(8, 24), seed=st.integers(0, 2**62))
def test_a_shifted_crop_keeps_a_window_of_the_image_and_fills_the_rest_black(side: int, seed: int) -> None:
    x = torch.randint(1, 256, (1, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed % 99))

    out = augment_images(x, "flip_crop", [seed])[0]

    pad = max(1, side // 8)
    kept = (out != 0).all(dim=0)
    rows, cols = kept.any(dim=1).nonzero().flatten(), kept.any(dim=0).nonzero().flatten()
    assert side - pad <= len(rows) <= side and side - pad <= len(cols) <= side
    window = out[:, rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    assert any(  # the window comes from the image or from its mirror
        torch.equal(window, src[:, r : r + window.shape[1], c : c + window.shape[2]])
        for src in (x[0], x[0].flip(-1))
        for r in range(side - window.shape[1] + 1)
        for c in range(side - window.shape[2] + 1)
    )


def test_a_lease_sees_the_images_another_device_sees_and_another_version_sees_others() -> None:
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16)

    class Reader:
        def read(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
            return x[start : start + count], y[start : start + count]

    ranges = [SampleRange(shard="c" * 64, start=2, count=10)]
    readers = {"c" * 64: Reader()}

    mine, yours = (gather_samples(ranges, readers, augment="flip", version=7) for _ in range(2))  # type: ignore[arg-type]
    later = gather_samples(ranges, readers, augment="flip", version=8)  # type: ignore[arg-type]
    plain = gather_samples(ranges, readers, augment="none", version=7)  # type: ignore[arg-type]

    assert torch.equal(mine[0], yours[0]) and torch.equal(mine[1], y[2:12])
    assert not torch.equal(mine[0], later[0])  # ten coins, all alike in two versions: 1 in 1024
    assert torch.equal(plain[0], x[2:12])
    assert sample_seed("c" * 64, 2, 7) != sample_seed("c" * 64, 3, 7)


def test_a_flip_is_a_fair_coin() -> None:
    image = torch.arange(3 * 8 * 8, dtype=torch.uint8).reshape(1, 3, 8, 8)

    flipped = sum(
        not torch.equal(augment_images(image, "flip", [sample_seed("d" * 64, i, 0)]), image) for i in range(400)
    )

    assert 160 <= flipped <= 240  # half of 400, well inside chance's spread

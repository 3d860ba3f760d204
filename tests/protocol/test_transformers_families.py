"""The llama, gpt2, vit and resnet families: built by transformers from configuration only, the same on every
device, without dropout, and (resnet) with gradients that add up over microbatches."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from crowdtrain_agent.models import ModelConfigError, get_model, hf

SMALL: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "block_size": 16},
    "gpt2": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
    "vit": {"image_size": 16, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "num_labels": 5},
    "resnet": {"image_size": 16, "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "num_labels": 5},
}  # fmt: skip


def _batch(name: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    config = get_model(name).validate(SMALL[name])
    if get_model(name).data_kind == "text":
        tokens = torch.randint(0, 256, (n, config["block_size"] + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    images = torch.randint(0, 256, (n, 3, config["image_size"], config["image_size"]), generator=gen, dtype=torch.uint8)
    return images, torch.randint(0, config["num_labels"], (n,), generator=gen)


def _gradient(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    entry = get_model(name)
    model = entry.build(SMALL[name], seed=7)
    model.train()
    entry.loss_sum(model, x, y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _digest(name: str) -> str:
    model = get_model(name).build(SMALL[name], seed=7)
    return hashlib.sha256(torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()).hexdigest()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_seed_builds_the_same_parameters_in_another_process(name: str) -> None:
    code = f"import sys, json; from tests.protocol.test_transformers_families import _digest; print(_digest({name!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)

    assert other.stdout.strip() == _digest(name)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_two_computations_of_one_batch_give_one_gradient_so_copies_can_be_compared(name: str) -> None:
    x, y = _batch(name, 4)

    torch.testing.assert_close(_gradient(name, x, y), _gradient(name, x, y), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_microbatch_gradients_add_up_to_the_batch_gradient(name: str) -> None:
    # The aggregators sum microbatch gradients: a batch norm on batch statistics (resnet's, unfrozen) breaks this.
    x, y = _batch(name, 4)

    whole = _gradient(name, x, y)
    parts = _gradient(name, x[:2], y[:2]) + _gradient(name, x[2:], y[2:])

    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-5)


def test_the_frozen_resnet_loads_into_the_librarys_own_class() -> None:
    model = get_model("resnet").build(SMALL["resnet"], seed=7)
    lib = hf.transformers_module()
    config = lib.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5)
    plain = lib.ResNetForImageClassification(config).eval()

    loaded = plain.load_state_dict(model.state_dict(), strict=True)

    x = hf.pixels(_batch("resnet", 2)[0])
    torch.testing.assert_close(plain(pixel_values=x).logits, model(pixel_values=x).logits)
    assert not loaded.missing_keys and not loaded.unexpected_keys


def test_a_family_explains_a_bad_shape_by_its_field() -> None:
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value") as e:
        get_model("llama").validate({**SMALL["llama"], "num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match="image_size .20. must be a multiple of patch_size") as v:
        get_model("vit").validate({**SMALL["vit"], "image_size": 20})

    assert (e.value.field, v.value.field) == ("num_key_value_heads", "image_size")


def test_flops_are_counted_from_the_model_and_grow_with_it() -> None:
    entry = get_model("llama")

    two = entry.flops_per_sample(SMALL["llama"])
    four = entry.flops_per_sample({**SMALL["llama"], "num_hidden_layers": 4})

    assert four > two > 3 * 2 * 16 * entry.param_count(SMALL["llama"]) // 4


def test_another_transformers_version_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    hf.transformers_module.cache_clear()
    monkeypatch.setattr(transformers, "__version__", "4.0.0")
    try:
        with pytest.raises(hf.LibraryMismatch, match="pip install transformers==5.23.0"):
            hf.transformers_module()
    finally:
        hf.transformers_module.cache_clear()


def test_threads_of_a_fresh_process_build_and_count_a_family_at_once() -> None:
    # A site process's scheduler threads read a new campaign together; the library resolves its names lazily,
    # and two threads resolving one name at once once saw "module 'transformers' has no attribute ...".
    code = (
        "import threading\n"
        "from crowdtrain_agent.models import get_model\n"
        "from tests.protocol.test_transformers_families import SMALL\n"
        "errors = []\n"
        "def work(name):\n"
        "    try:\n"
        "        get_model(name).flops_per_sample(SMALL[name]); get_model(name).build(SMALL[name], seed=1)\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=work, args=(n,)) for n in sorted(SMALL) * 4]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(errors)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=180)

    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_peers_are_sent_only_the_fields_away_from_their_defaults() -> None:
    llama = get_model("llama")
    full = llama.validate({"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4})

    sent = llama.compact(full)

    # An agent of the release before rms_norm_eps and rope_theta existed can still build this model.
    assert sent == {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4}
    assert llama.validate(sent) == full
    assert llama.compact({**full, "rope_theta": 5e5})["rope_theta"] == 5e5

"""The home-link benchmark's GPT is the demo campaign's (restated there because it runs before Django is set up)."""

from __future__ import annotations

import inspect

from crowdtrain.campaigns.demo import DEMO_CORPUS_BYTES, DEMO_MODEL, seed_demo_campaign
from tests.benchmarks import homelink


def test_the_benchmarks_gpt_is_the_demos() -> None:
    defaults = {k: p.default for k, p in inspect.signature(seed_demo_campaign).parameters.items()}

    assert homelink.GPT_MODEL == DEMO_MODEL
    assert homelink.GPT_CORPUS_BYTES == DEMO_CORPUS_BYTES
    assert (homelink.GPT_LR, homelink.GPT_BATCH, homelink.GPT_MICROBATCH) == (
        defaults["lr"],
        defaults["target_batch_size"],
        defaults["microbatch_size"],
    )

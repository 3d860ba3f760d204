"""The demo campaign: a byte-level GPT on the Python standard library's own source."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from crowdtrain.datasets.models import Dataset
from crowdtrain.datasets.sharding import create_text_dataset, stdlib_corpus

from .models import Campaign
from .setup import create_campaign

DEMO_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}
DEMO_CORPUS_BYTES = 4 << 20
DEMO_NAME = "Python stdlib GPT (demo)"


@transaction.atomic
def seed_demo_campaign(
    *,
    max_steps: int | None = None,
    target_batch_size: int = 256,
    microbatch_size: int = 16,
    staleness: int = 1,
    num_aggregators: int = 1,
    lr: float = 3e-3,
) -> Campaign:
    """Create (or reuse) the demo dataset and a fresh running demo campaign."""
    owner, _ = get_user_model().objects.get_or_create(username="demo-organizer")
    sample_len = DEMO_MODEL["block_size"] + 1
    dataset = Dataset.objects.filter(name="python-stdlib", sample_len=sample_len).first()
    if dataset is None:
        dataset = create_text_dataset(
            "python-stdlib", stdlib_corpus(DEMO_CORPUS_BYTES), sample_len, shard_bytes=1 << 20
        )
    campaign = create_campaign(
        name=DEMO_NAME,
        owner=owner,
        dataset=dataset,
        architecture="gpt",
        model_config=DEMO_MODEL,
        optimizer={"name": "adamw", "lr": lr, "weight_decay": 0.0},
        target_batch_size=target_batch_size,
        microbatch_size=microbatch_size,
        codec="fp32",
        staleness=staleness,
        num_aggregators=num_aggregators,
        max_steps=max_steps,
        checkpoint_every=10,
        seed=1234,
    )
    campaign.state = Campaign.State.RUNNING
    campaign.save(update_fields=["state", *campaign.stamp_state()])
    return campaign

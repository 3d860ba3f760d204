"""Seed a local run from a JSON spec: datasets, running campaigns, aggregator and agent tokens.

The demo, the end-to-end tests and the benchmark run the site in a child
process on its own SQLite file; this command is how they fill that file
without sharing an ORM connection with it. It prints one JSON object::

    ./manage.py seed_run --migrate --spec run.json
    {"campaigns": [1], "aggregators": {"agg-1": "ctb_..."}, "agents": {"agent-1": "ctd_..."}}

Spec (every key optional)::

    {"campaigns": [
        {"preset": "demo", "max_steps": 30, "target_batch_size": 128},
        {"dataset": {"kind": "npz", "path": "w1.npz", "name": "w1", "validation_fraction": 0.05},
         "name": "W1", "architecture": "mlp", "model_config": {...}, "optimizer": {...},
         "target_batch_size": 1024, "microbatch_size": 64, "staleness": 1, "max_steps": 40},
        {"dataset": {"kind": "stdlib", "bytes": 1048576, "sample_len": 33}, "architecture": "gpt", ...},
        {"dataset": {...}, "pretrained": {"path": "llama.zip"}, "model_config": {"block_size": 32}, ...}],
     "aggregators": ["agg-1"], "agents": ["agent-1", "agent-2"], "bulk_agents": 10000,
     "joined_s_ago": {"agent-2": 0}}

``joined_s_ago`` says how long ago an agent's volunteer signed up (default: the
n-th agent's n half-hours ago, so seeded volunteers do not look alike).

``bulk_agents`` creates that many more volunteers, each with one device
(``sim-1``, ``sim-2``, ...), in a few bulk inserts instead of one at a time:
the scale benchmark seeds 10,000 this way in seconds. Their tokens come back
in order as ``"bulk_agents": ["ctd_...", ...]``, and only their hashes are stored.

Seed campaigns before their aggregators connect: the site assigns slices
when an aggregator says hello.
"""

from __future__ import annotations

import hashlib
import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from crowdtrain.accounts.models import Device, Profile
from crowdtrain.accounts.tokens import hash_token, new_token
from crowdtrain.campaigns.demo import seed_demo_campaign
from crowdtrain.campaigns.models import Campaign
from crowdtrain.campaigns.settings_table import SETTINGS
from crowdtrain.campaigns.setup import CampaignConfigError, create_campaign, prepare_initial_weights
from crowdtrain.datasets.models import Dataset, Pretrained
from crowdtrain.datasets.pretrained import PretrainedError, convert, record_fields
from crowdtrain.datasets.sharding import (
    DatasetError,
    create_npz_dataset,
    create_text_dataset,
    shard_source,
    stdlib_corpus,
)
from crowdtrain.scheduler.models import Aggregator

# Every setting of the table, with the bounds the campaign form enforces (create_campaign checks them).
CAMPAIGN_FIELDS = {"name", "architecture", "model_config", "optimizer", *SETTINGS}


def _dataset(spec: dict[str, Any]) -> Dataset:
    kind = spec.get("kind")
    shard_bytes = int(spec.get("shard_bytes", 1 << 20))
    if kind == "npz":
        path = Path(spec["path"])
        return create_npz_dataset(
            spec.get("name", path.stem),
            path.read_bytes(),
            shard_bytes,
            validation_fraction=float(spec.get("validation_fraction", 0.0)),
        )
    if kind == "stdlib" and spec.get("tokenizer") == "train":
        # Tokenized as an upload with a trained BPE is: token shards, the tokenizer stored beside them.
        corpus = stdlib_corpus(int(spec.get("bytes", 1 << 20)))
        return _sharded(spec, Dataset.Format.TEXT, corpus, shard_bytes, kind=Dataset.Kind.TOKENS,
                        vocab_size=int(spec["vocab_size"]), sample_len=int(spec["sample_len"]))  # fmt: skip
    if kind == "stdlib":
        corpus = stdlib_corpus(int(spec.get("bytes", 1 << 20)))
        return create_text_dataset(
            spec.get("name", "python-stdlib"),
            corpus,
            int(spec["sample_len"]),
            shard_bytes,
            validation_fraction=float(spec.get("validation_fraction", 0.0)),
        )
    if kind == "images":
        path = Path(spec["path"])
        return _sharded(spec, Dataset.Format.IMAGES, path.read_bytes(), shard_bytes, kind=Dataset.Kind.TENSORS,
                        image_size=int(spec.get("image_size", 16)))  # fmt: skip
    raise CommandError(f"dataset kind must be 'npz', 'stdlib' or 'images', got {kind!r}")


def _sharded(spec: dict[str, Any], fmt: str, data: bytes, shard_bytes: int, **fields: Any) -> Dataset:
    """A dataset made from ``data`` by the upload's own sharding (tokenizing, decoding images)."""
    dataset = Dataset.objects.create(
        name=spec.get("name", fmt),
        source_format=fmt,
        source_sha256=hashlib.sha256(data).hexdigest(),
        validation_fraction=float(spec.get("validation_fraction", 0.0)),
        **fields,
    )
    return shard_source(dataset, lambda: io.BytesIO(data), len(data), shard_bytes=shard_bytes)


def _pretrained(spec: dict[str, Any], owner: Any) -> Pretrained:
    """Pretrained weights from a zipped transformers folder on disk, converted as an upload would be."""
    path = Path(spec["path"])
    try:
        with path.open("rb") as fh:
            converted = convert(fh, lambda fraction: None)
    except (OSError, PretrainedError) as exc:
        raise CommandError(f"pretrained weights {path}: {exc}") from None
    return Pretrained.objects.create(name=spec.get("name", path.stem), owner=owner, **record_fields(converted))


def _campaign(spec: dict[str, Any], owner: Any) -> Campaign:
    if spec.get("preset") == "demo":
        kwargs = {k: v for k, v in spec.items() if k != "preset"}
        return seed_demo_campaign(**kwargs)
    unknown = set(spec) - CAMPAIGN_FIELDS - {"dataset", "pretrained"}
    if unknown:
        raise CommandError(f"unknown campaign field(s) {sorted(unknown)}; known: {sorted(CAMPAIGN_FIELDS)}")
    fields = {k: v for k, v in spec.items() if k in CAMPAIGN_FIELDS}
    weights = _pretrained(spec["pretrained"], owner) if "pretrained" in spec else None
    if weights is not None:  # the weights decide the model, with the spec's context length if it has one
        fields["architecture"] = weights.architecture
        fields["model_config"] = {**weights.model_config, **fields.get("model_config", {})}
    fields.setdefault("name", f"{spec.get('architecture', 'model')} campaign")
    campaign = create_campaign(owner=owner, dataset=_dataset(spec.get("dataset", {})), pretrained=weights, **fields)
    prepare_initial_weights(campaign)  # as starting it does
    campaign.state = Campaign.State.RUNNING
    campaign.save(update_fields=["state", *campaign.stamp_state()])
    return campaign


class Command(BaseCommand):
    help = "Create datasets, running campaigns and tokens from a JSON spec; print ids and tokens as JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--spec", required=True, help="path of the JSON spec (see the module docstring)")
        parser.add_argument("--migrate", action="store_true", help="apply migrations first (saves a second start-up)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            spec = json.loads(Path(options["spec"]).read_text())
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read the run spec {options['spec']}: {exc}") from None
        if options["migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        try:
            result = self._seed(spec)
        except (CampaignConfigError, DatasetError, KeyError, TypeError) as exc:
            raise CommandError(f"bad run spec {options['spec']}: {exc}") from None
        self.stdout.write(json.dumps(result))

    @transaction.atomic
    def _seed(self, spec: dict[str, Any]) -> dict[str, Any]:
        users = get_user_model().objects
        owner, _ = users.get_or_create(username="organizer")
        campaigns = [_campaign(c, owner).pk for c in spec.get("campaigns", [])]
        aggregators: dict[str, str] = {}
        for name in spec.get("aggregators", []):
            token = new_token("ctb")
            Aggregator.objects.update_or_create(name=name, defaults={"token_hash": hash_token(token)})
            aggregators[name] = token
        agents: dict[str, str] = {}
        joined = spec.get("joined_s_ago", {})
        now = timezone.now()
        for i, name in enumerate(spec.get("agents", [])):
            # One volunteer per agent, each joined at another time (default: half an hour apart), as strangers
            # do: volunteers who joined within minutes of each other check each other's work only through the
            # referee (``verification.affinity``).
            when = now - timedelta(seconds=float(joined.get(name, JOINED_APART_S * (i + 1))))
            volunteer, _ = users.get_or_create(username=f"volunteer-{name}", defaults={"date_joined": when})
            agents[name] = Device.issue(volunteer, name)[1]
        result = {"campaigns": campaigns, "aggregators": aggregators, "agents": agents}
        if "bulk_agents" in spec:
            result["bulk_agents"] = _bulk_agents(int(spec["bulk_agents"]))
        return result


JOINED_APART_S = 1800.0
BULK_JOINED_S = 10**7  # bulk volunteers joined before the named agents' volunteers, none at the same time
BULK_BATCH = 2000  # rows per INSERT: large enough to be quick, small enough for SQLite's variable limit


def _bulk_agents(count: int) -> list[str]:
    """``count`` volunteers with one device each, inserted in batches; returns the devices' tokens in order.

    bulk_create sends no post_save signal, so the profiles the signal would
    make are inserted here too (the welcome and the pages read them).
    """
    if count < 0:
        raise CommandError(f"bulk_agents must be a count >= 0, got {count}")
    user_model = get_user_model()
    now = timezone.now()
    users = user_model.objects.bulk_create(
        [
            user_model(
                username=f"volunteer-sim-{i + 1}",
                date_joined=now - timedelta(seconds=BULK_JOINED_S + JOINED_APART_S * i),
            )
            for i in range(count)
        ],
        batch_size=BULK_BATCH,
    )
    Profile.objects.bulk_create([Profile(user=user) for user in users], batch_size=BULK_BATCH)
    tokens = [new_token("ctd") for _ in range(count)]
    Device.objects.bulk_create(
        [
            Device(owner=user, name=f"sim-{i + 1}", token_hash=hash_token(token))
            for i, (user, token) in enumerate(zip(users, tokens, strict=True))
        ],
        batch_size=BULK_BATCH,
    )
    return tokens

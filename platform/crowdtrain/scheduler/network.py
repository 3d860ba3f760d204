"""What leases cost the volunteers' links: the done report's figures, bounded, and each step's totals.

An agent of protocol 2.3 states in its done report the bytes it uploaded for
the lease, the bytes it downloaded since its previous report, and the seconds
its device waited on the network meanwhile (``LeaseDone.bytes_up``,
``bytes_down``, ``network_s``). They are a stranger's numbers: each is held
within what the campaign makes possible before it reaches the hot state, so a
lying agent moves the campaign's figures by at most the bounded value of its
own leases' share.

``bytes_up == 0`` means "not reported": every real lease uploads its whole
gradient, and an older agent's report decodes with the field's default of 0.
Such leases count in neither the bytes per sample nor the network share (they
are *unreported samples*), rather than as leases that cost nothing.

The figures ride in the lease's record in Redis (the done script keeps them
next to its compute time) and reach the database with the step's commit, in
the same transaction: the done path gains no statement of its own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.protocol import LeaseDone

from .configs import CampaignConfig
from .hotrecords import LeaseRecord

logger = logging.getLogger(__name__)

# On top of the codec's payload (``Codec.encoded_size``, int8's scales included): the chunk headers; a
# resend after a dropped connection sends a slice twice (crowdtrain_agent.uploader).
UPLOAD_OVERHEAD = 1 / 8
UPLOAD_SENDS = 2
SLICE_SLACK_BYTES = 1 << 10  # per slice: the chunk headers (64 bytes each) of a slice too small for an eighth
# A lease names at most this many shards to fetch ahead (``leasing``): enough for the next lease of its size.
# A local-steps round of 65,536 W1 samples spans 16 shards of 4 MiB; named 8, a volunteer on a home link
# waited ~3 s for the other 8 at the start of every round.
MAX_PREFETCH_SHARDS = 64
# Between two reports an agent may fetch a few versions' parameters (leases it gave back, a rollback)
# and the shards of its lease and of the next ones: up to MAX_PREFETCH_SHARDS each.
PARAM_DOWNLOADS = 4
SHARD_DOWNLOADS = 2 * MAX_PREFETCH_SHARDS


@dataclass(frozen=True)
class LeaseTraffic:
    """One lease's reported cost, bounded; ``bytes_up == 0``: not reported (an older agent)."""

    bytes_up: int = 0
    bytes_down: int = 0
    network_s: float = 0.0


def upload_bounds(config: CampaignConfig) -> tuple[int, int]:
    """The fewest and the most bytes one lease's upload can take in this campaign's codec."""
    payload = get_codec(config.codec, config.codec_block_size).encoded_size(config.param_count)
    most = UPLOAD_SENDS * (math.ceil(payload * (1 + UPLOAD_OVERHEAD)) + SLICE_SLACK_BYTES * max(1, len(config.slices)))
    return payload, most


def download_bound(config: CampaignConfig) -> int:
    """The most bytes one report may say its agent downloaded since its previous report."""
    return PARAM_DOWNLOADS * 4 * config.param_count + SHARD_DOWNLOADS * settings.CROWDTRAIN_SHARD_BYTES


def bounded(config: CampaignConfig, done: LeaseDone) -> LeaseTraffic:
    """The report's figures, each clamped into what the campaign makes possible.

    Clamped rather than dropped: an honest agent past a bound (a flaky link
    that resent more than once) still counts, near its real cost, and a liar
    moves the figures by at most the bound. Seconds are bounded by the time
    the lease was held in the done script, which alone knows it.
    """
    if done.bytes_up <= 0:
        return LeaseTraffic()
    fewest, most = upload_bounds(config)
    up = min(max(done.bytes_up, fewest), most)
    down = min(done.bytes_down, download_bound(config))
    seconds = done.network_s if math.isfinite(done.network_s) else 0.0
    if (up, down) != (done.bytes_up, done.bytes_down):
        logger.debug(
            "lease %s reports %s bytes up and %s down; counted as %s and %s (the campaign's bounds)",
            done.lease_id,
            done.bytes_up,
            done.bytes_down,
            up,
            down,
            extra={"campaign_id": config.id, "lease_id": done.lease_id},
        )
    return LeaseTraffic(up, down, max(0.0, seconds))


def hot_args(traffic: LeaseTraffic) -> dict[str, Any]:
    """The done script's arguments for a lease's cost (it keeps them in the lease's record)."""
    return {"nu": traffic.bytes_up, "nd": traffic.bytes_down, "ns": traffic.network_s}


def step_totals(leases: list[LeaseRecord]) -> dict[str, Any]:
    """A step's row of ``StepNetwork`` from its leases' records in the hot state (``hot_args``' fields).

    A record without them (rebuilt from the database after Redis lost it, or
    written by an older site) counts as unreported.
    """
    samples = unreported = bytes_up = bytes_down = 0
    network_s = compute_s = 0.0
    for lease in leases:
        if lease.bytes_up <= 0:
            unreported += lease.samples
            continue
        samples += lease.samples
        bytes_up += lease.bytes_up
        bytes_down += lease.bytes_down
        network_s += lease.network_s
        compute_s += lease.compute_s
    return {
        "samples": samples,
        "unreported_samples": unreported,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "network_s": network_s,
        "compute_s": compute_s,
    }

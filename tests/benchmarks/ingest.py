"""Aggregator intake: fp32 gradient slices with valid tickets, uploaded straight to one aggregator and timed.

The bench knows the site's ticket key (it sets CROWDTRAIN_TICKET_KEY for the
site it starts and derives the campaign's key from it), so it can sign tickets for made-up leases; the aggregator
checks them exactly as it checks an agent's. The uploads go through the
agent's own ``Uploader``, so this measures the real client and server path:
chunking, WebSocket frames, decoding, finiteness checks and the receipt.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from crowdtrain_agent.codec import encode_fp32
from crowdtrain_agent.protocol import Ticket, UploadBegin, campaign_key, chunk_fragments, sign_ticket
from crowdtrain_agent.uploader import Uploader

# Lease ids far above anything the site has issued, so they never collide with real leases.
FIRST_FAKE_LEASE = 1_000_000_000


@dataclass(frozen=True)
class IngestResult:
    uploads: int
    bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6


async def _upload_all(url: str, key: bytes, *, campaign_id: int, slice_index: int, numel: int, version: int,
                      uploads: int, warmup: int) -> IngestResult:  # fmt: skip
    payload = encode_fp32(torch.randn(numel) * 1e-3)
    chunks = chunk_fragments(payload)  # as the agent sends a slice: header and payload fragments
    uploader = Uploader()
    try:
        started, sent = time.perf_counter(), 0
        for i in range(warmup + uploads):
            if i == warmup:
                started, sent = time.perf_counter(), 0
            ticket = Ticket(
                lease_id=FIRST_FAKE_LEASE + i, campaign_id=campaign_id, device_id=1, base_version=version,
                num_samples=1024, expires_at=time.time() + 3600,
            )  # fmt: skip
            signed = sign_ticket(ticket, campaign_key(key, campaign_id))  # the campaign's own key, as the site signs
            begin = UploadBegin(ticket=signed, slice_index=slice_index, codec="fp32",
                                num_elements=numel, num_chunks=len(chunks))  # fmt: skip
            await uploader.upload(url, begin, chunks)  # raises UploadError on any rejection
            sent += len(payload)
        return IngestResult(uploads, sent, time.perf_counter() - started)
    finally:
        await uploader.close()


def measure_ingest(url: str, key: bytes, *, campaign_id: int, slice_index: int, numel: int, version: int,
                   uploads: int = 40, warmup: int = 3) -> IngestResult:  # fmt: skip
    """Upload ``uploads`` slices of ``numel`` fp32 values one after another on one connection; time them.

    The slices stay pending in the aggregator (no commit names them), so
    ``(uploads + warmup) * numel * 4`` bytes must fit its pending budget.

    Raises:
        UploadError: if the aggregator refuses an upload (bad ticket, stale version, budget).
    """
    return asyncio.run(_upload_all(url, key, campaign_id=campaign_id, slice_index=slice_index, numel=numel,
                                   version=version, uploads=uploads, warmup=warmup))  # fmt: skip

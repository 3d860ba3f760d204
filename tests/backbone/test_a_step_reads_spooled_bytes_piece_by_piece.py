"""A step's passes over spooled bytes hold a piece of each at a time, never whole slices.

The sum of a commit, a delta body and a snapshot's checksum each read every
byte of slices that wait in the spool. Read whole, their pages stayed
resident until the pass ended: at 100M parameters the sum held two uploads
and a delta four slices' worth at once, 30-34 bytes per parameter of the
slice at the peak where the aggregator holds 19 between steps. Here each
pass is measured by the process's peak resident set (VmHWM, reset before it)
and checked against what it must hold; the bytes are checked against the
same pass made whole, in memory.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain_agent.deltas import decode_delta
from crowdtrain_backbone import aggregation
from crowdtrain_backbone.aggregation import MeanRule, PendingUpload
from crowdtrain_backbone.downloads import DownloadCache
from crowdtrain_backbone.slices import Snapshot
from crowdtrain_backbone.spool import Spool

from .conftest import gradient

MIB = 1 << 20
NUMEL = 16 * MIB  # 64 MiB of fp32 per upload or version
SLACK = 24 * MIB  # the interpreter's own allocations while a pass runs


def _reset_peak() -> int:
    """Make the peak resident set the current one, and return it."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmHWM:")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def _spooled(spool: Spool, lease_id: int, grad: torch.Tensor) -> PendingUpload:
    kept, pages = spool.keep(grad)
    assert pages is not None
    return PendingUpload(lease_id, 0, 4, kept, pages=pages)


def test_a_commit_sums_spooled_uploads_a_piece_of_each_at_a_time(tmp_path: Path) -> None:
    spool = Spool(tmp_path, min_bytes=0)
    uploads = [_spooled(spool, lease, gradient(NUMEL, lease)) for lease in range(1, 5)]
    expected = (uploads[0].grad + uploads[1].grad + uploads[2].grad + uploads[3].grad) / 16.0
    for upload in uploads:
        upload.release_pages()

    before = _reset_peak()
    total = MeanRule().combine(uploads, 16)
    grew = _status("VmHWM:") - before

    assert torch.equal(total, expected)
    # The sum itself is 64 MiB; a piece of each of the four uploads is 4 x 16 MiB. Whole, the first
    # two uploads alone were 128 MiB more.
    allowed = NUMEL * 4 + 4 * 16 * MIB + SLACK
    assert grew < allowed, f"the commit's peak grew by {grew / MIB:.0f} MiB (allowed {allowed / MIB:.0f})"


def test_a_delta_and_a_checksum_of_spooled_versions_hold_pieces(tmp_path: Path) -> None:
    spool = Spool(tmp_path, min_bytes=0)
    held_values = gradient(NUMEL, 1)
    wanted_values = held_values + 1e-3 * gradient(NUMEL, 2)
    held = Snapshot(0, spool.hold_fp32(held_values), '"v0"')
    wanted = Snapshot(1, spool.hold_fp32(wanted_values), '"v1"')
    exact = wanted_values.numpy().tobytes()
    del held_values, wanted_values
    cache = DownloadCache(spool=spool)

    before = _reset_peak()
    body = asyncio.run(cache.delta(wanted, held))
    checksum = asyncio.run(cache.checksum(wanted))
    grew = _status("VmHWM:") - before

    assert decode_delta(body, held.body) == exact
    assert checksum == hashlib.sha256(exact).hexdigest()
    # Whole, the planes and the body were 64 MiB each, on top of both versions' pages read (128 MiB).
    assert grew < 2 * 16 * MIB + SLACK, f"the delta and checksum's peak grew by {grew / MIB:.0f} MiB"


@settings(max_examples=40, deadline=None)
@given(
    scales=st.lists(st.sampled_from([1.0, 1.0, 0.5, 0.1]), min_size=1, max_size=5),
    numel=st.integers(1, 3000),
    piece=st.sampled_from([1, 7, 1024]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_sum_in_pieces_is_the_sum_made_whole_bit_for_bit(
    scales: list[float], numel: int, piece: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(numel, generator=generator) * 10**i for i in range(len(scales))]
    uploads = [PendingUpload(i + 1, 0, 3, g, scale=s) for i, (g, s) in enumerate(zip(grads, scales, strict=True))]
    samples = 3 * len(uploads)
    scaled = any(s != 1.0 for s in scales)
    whole = grads[0] * scales[0] if scaled else grads[0].clone()
    for g, s in zip(grads[1:], scales[1:], strict=True):
        if scaled:
            whole.add_(g, alpha=s)
        else:
            whole.add_(g)
    whole.div_(float(samples))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aggregation, "PIECE_ELEMENTS", piece)
        got = MeanRule().combine(uploads, samples)

    assert torch.equal(got.view(torch.int32), whole.view(torch.int32))

"""Large pending uploads and published versions wait in the spool, not in memory; steps are as in memory.

The rest of tests/backbone runs every upload through the spool too
(``conftest.backbone_config``); here: what the spool holds is the bytes that
came, bit for bit; a step over spooled uploads equals the same step over
uploads in memory; the process's anonymous memory does not grow by what it
holds; and a spool folder it cannot write keeps uploads in memory instead of
refusing them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crowdtrain_agent.deltas import decode_delta
from crowdtrain_agent.protocol import ModelSpec, SliceReady, StepApplied, UploadReceipt
from crowdtrain_backbone import downloads
from crowdtrain_backbone.aggregation import MeanRule, PendingUpload
from crowdtrain_backbone.config import ConfigError, load_config
from crowdtrain_backbone.robust import CenteredClipRule, ClipHistory, TrimmedMeanRule, clip_contributions
from crowdtrain_backbone.slices import Snapshot
from crowdtrain_backbone.spool import Spool

from .conftest import FakeSite, agent_connection, assignment, gradient, running_backbone, ticket

MIB = 1 << 20


def _rss_anon() -> int:
    """This process's anonymous resident memory in bytes: what the kernel cannot take back by dropping caches.

    Read after the garbage collector and glibc's ``malloc_trim``: memory this process freed (the test's own
    agent encodes and sends each upload from here) is not memory it holds.
    """
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_spool_gives_back_the_bytes_it_took_even_after_their_pages_left(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", min_bytes=0)
    grad = torch.randn(300_001)
    grad[7] = float("nan")  # bit patterns, not values: a NaN payload comes back as it went

    kept, pages = spool.keep(grad)
    first = kept.clone()
    PendingUpload(1, 0, 4, kept, pages=pages).release_pages()

    assert pages is not None
    assert torch.equal(first.view(torch.int32), grad.view(torch.int32))
    assert torch.equal(kept.view(torch.int32), grad.view(torch.int32))  # read again from the file
    assert list((tmp_path / "spool").iterdir()) == []  # nameless: nothing to clean up, ever


def test_any_bytes_are_held_as_they_came_an_odd_length_included(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", min_bytes=0)
    data = bytes(range(256)) * 4099 + b"odd"  # a delta body need not be whole fp32 values

    held = spool.hold(data)

    assert isinstance(held, mmap.mmap) and held[:] == data


def test_small_gradients_stay_in_memory(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", min_bytes=4 * MIB)
    grad = torch.randn(1000)

    kept, pages = spool.keep(grad)

    assert pages is None and kept is grad


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 6),
    numel=st.integers(1, 5000),
    seed=st.integers(0, 2**31 - 1),
    clip=st.sampled_from([0.0, 1.5]),
)
def test_every_rule_combines_spooled_uploads_bit_for_bit_as_uploads_in_memory(
    tmp_path_factory: pytest.TempPathFactory, count: int, numel: int, seed: int, clip: float
) -> None:
    spool = Spool(tmp_path_factory.mktemp("spool"), min_bytes=0)
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(numel, generator=generator) * (1 + 10 * i) for i in range(count)]
    in_memory = [PendingUpload(i + 1, 0, 2 + i, g) for i, g in enumerate(grads)]
    spooled = [_spooled(spool, i + 1, 2 + i, g) for i, g in enumerate(grads)]
    samples = sum(u.num_samples for u in in_memory)

    for rule in (MeanRule(), TrimmedMeanRule(0.2), CenteredClipRule()):
        expected = rule.combine(clip_contributions(in_memory, ClipHistory(), clip).uploads, samples)
        got = rule.combine(clip_contributions(spooled, ClipHistory(), clip).uploads, samples)
        assert torch.equal(got, expected), rule.name


async def test_pending_uploads_do_not_grow_the_aggregators_memory(site: FakeSite, tmp_path: Path) -> None:
    model = ModelSpec(architecture="mlp", config={"in_dim": 1024, "hidden": [2048], "classes": 1024})
    numel = 1024 * 2048 + 2048 + 2048 * 1024 + 1024  # 16 MiB of fp32 per upload
    leases = list(range(1, 7))
    async with running_backbone(site, tmp_path / "checkpoints", spool_min_bytes=MIB) as server:
        await site.assign(assignment(model=model, param_count=numel, bounds=(0, numel)))
        async with agent_connection(server) as agent:
            before = _rss_anon()
            for lease in leases:
                reply = await agent.upload(ticket(lease), gradient(numel, lease))
                assert isinstance(reply, UploadReceipt), reply
            held = _rss_anon() - before
        state = server.node.get_slice(1, 0)
        pending = dict(state.pending)

        applied = await site.commit(0, leases, 4 * len(leases))

    assert sorted(pending) == leases
    assert all(u.pages is not None for u in pending.values())
    # Six uploads are 100 MiB; the test's agent, in this process, encodes one at a time as it sends.
    assert held < 40 * MIB, f"anonymous memory grew by {held / MIB:.0f} MiB while holding 100 MiB of uploads"
    assert isinstance(applied, StepApplied) and applied.version == 1
    assert state.pending == {}
    # What it publishes waits in the spool too: every kept version's bytes, for every download.
    assert sorted(state.snapshots) == [0, 1]
    assert all(isinstance(s.body, mmap.mmap) for s in state.snapshots.values())


async def test_a_spool_folder_it_cannot_write_keeps_uploads_in_memory(
    site: FakeSite, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the spool folder should be")
    async with running_backbone(site, tmp_path / "checkpoints", spool_dir=blocker / "spool") as server:
        ready: SliceReady = await site.assign(assignment())
        async with agent_connection(server) as agent:
            await agent.good_upload(lease_id=1)

        upload = server.node.get_slice(1, 0).pending[1]
        assert ready.version == 0
        assert upload.pages is None  # in memory, and taken
        assert "cannot write to the spool folder" in caplog.text


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_a_bad_spool_size_is_refused_by_name(raw: str) -> None:
    with pytest.raises(ConfigError, match="CROWDTRAIN_BACKBONE_SPOOL_MIN_BYTES"):
        load_config({}, {"CROWDTRAIN_BACKBONE_TOKEN": "t", "CROWDTRAIN_BACKBONE_SPOOL_MIN_BYTES": raw})


def _spooled(spool: Spool, lease_id: int, num_samples: int, grad: torch.Tensor) -> PendingUpload:
    kept, pages = spool.keep(grad)
    assert pages is not None
    return PendingUpload(lease_id, 0, num_samples, kept, pages=pages)


def test_a_delta_whose_spool_file_fills_the_disk_is_made_in_memory_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path / "spool", min_bytes=0)
    held_values, wanted_values = torch.randn(200_000), torch.randn(200_000)
    held = Snapshot(0, spool.hold_fp32(held_values), "etag-0")
    wanted = Snapshot(1, spool.hold_fp32(wanted_values), "etag-1")
    written = 0

    def full_disk(_wanted: Any, _held: Any, out: Any, **kwargs: Any) -> None:
        nonlocal written
        out.write(b"\0" * 4096)  # part of the body, then the disk is full
        written += 4096
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(downloads, "write_delta", full_disk)

    body = downloads._delta(wanted, held, spool)

    assert written == 4096
    assert isinstance(body, bytes), "made in memory, not a mapping of the half-written file"
    assert decode_delta(body, held_values.numpy().tobytes()) == wanted_values.numpy().tobytes()
    assert "cannot write to the spool folder" in caplog.text
    assert list((tmp_path / "spool").iterdir()) == []

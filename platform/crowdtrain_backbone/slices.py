"""One slice of a campaign's parameters: its optimizer, pending gradient uploads and published versions.

Terms: a *pending upload* is one lease's gradient for this slice, summed over
the lease's samples, held until the site commits a step that names the lease
(or until no commit can use it any more). A *snapshot* is the fp32 bytes of
the slice at one version, served to agents over HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import secrets
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import IO, Any, TypeGuard

import numpy as np
import torch

from crowdtrain_agent.codec import encode_fp32
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import SliceAssignment, retained_versions
from crowdtrain_agent.protocol.schema import to_dict

from .aggregation import AggregationRule, MeanRule, PendingUpload
from .downloads import DownloadCache
from .optimizers import build_slice_optimizer, slice_segments
from .robust import ClipHistory, build_rule, clip_contributions
from .spool import Body, Spool, release_pages

__all__ = [
    "AggregationRule",
    "ClipHistory",
    "MeanRule",
    "MemoryBudget",
    "PendingUpload",
    "PretrainedUnavailable",
    "SliceState",
    "Snapshot",
    "StepRefused",
    "UploadRefused",
    "build_slice_optimizer",
    "initial_params",
    "make_snapshot",
    "pretrained_slice",
    "slice_segments",
]

logger = logging.getLogger(__name__)

# Lease ids already committed or dropped, remembered to reject replays. Bounded:
# a lease old enough to fall out is also far outside the version window.
MAX_REMEMBERED_LEASES = 1 << 16


class UploadRefused(Exception):
    """An upload this slice will not take; ``code`` goes to the agent in UploadRejected."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class StepRefused(Exception):
    """A commit this slice cannot apply; nothing changed. Becomes a StepFailed for the site."""

    def __init__(self, detail: str, missing: Sequence[int] = ()) -> None:
        super().__init__(detail)
        self.detail = detail
        self.missing = list(missing)


@dataclass(frozen=True)
class Snapshot:
    """The published bytes of one version; immutable, so the ETag is a content hash.

    ``body`` is a mapping of a spool file for a slice the spool takes
    (``crowdtrain_backbone.spool``): every download reads it, none changes it.
    """

    version: int
    body: Body
    etag: str

    def release_pages(self) -> None:
        """Downloads done with it for now: a spooled body's pages leave the resident set."""
        release_pages(self.body)


class MemoryBudget:
    """Bytes of pending gradients the whole process may hold, shared by every slice."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def try_reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit; the caller must ``release`` them when the upload goes away."""
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)


# Opens the site's stream of the pretrained weights with this sha256 (``AggregatorNode.open_weights``).
WeightsOpener = Callable[[str], IO[bytes]]


def initial_params(assignment: SliceAssignment, open_weights: WeightsOpener | None = None) -> torch.Tensor:
    """Elements ``start:end`` of version 0: the pretrained weights the assignment names, else the seeded model's.

    Raises:
        ValueError: if the model does not have ``param_count`` parameters or the range does not fit.
        PretrainedUnavailable: the pretrained weights cannot be fetched, or are not the ones named.
    """
    if assignment.initial:
        if open_weights is None:
            raise PretrainedUnavailable("this aggregator has no way to fetch pretrained weights")
        return pretrained_slice(assignment, open_weights)
    model = get_model(assignment.model.architecture).build(assignment.model.config, seed=assignment.seed)
    # The slice's elements only, in flat parameter order: a flat copy of the whole model first was
    # another 4 bytes per parameter of the model at once, on top of the model itself.
    out = torch.empty(max(0, assignment.end - assignment.start), dtype=torch.float32)
    offset = 0
    for param in model.parameters():
        low, high = max(offset, assignment.start), min(offset + param.numel(), assignment.end)
        if low < high:
            flat = param.detach().reshape(-1)
            out[low - assignment.start : high - assignment.start] = flat[low - offset : high - offset]
        offset += param.numel()
    if offset != assignment.param_count:
        raise ValueError(
            f"campaign {assignment.campaign_id}: model {assignment.model.architecture} has {offset} "
            f"parameters but the assignment says {assignment.param_count}; the site and this aggregator run "
            "different model registries, upgrade crowdtrain-agent on the aggregator"
        )
    return out


class PretrainedUnavailable(RuntimeError):
    """The pretrained weights a campaign starts from could not be fetched whole and verified."""


def pretrained_slice(assignment: SliceAssignment, open_weights: WeightsOpener) -> torch.Tensor:
    """This slice's elements of the pretrained weights, read from the site's stream of the whole vector.

    Every byte is hashed, not only the slice's: the sha256 the site named is
    of the whole vector, and a slice of damaged weights must never become a
    campaign's version 0.

    Raises:
        PretrainedUnavailable: saying what went wrong (the download, the size, the hash).
    """
    sha = assignment.initial
    first, last = assignment.start * 4, assignment.end * 4
    expected = assignment.param_count * 4
    out = torch.empty(assignment.end - assignment.start, dtype=torch.float32)
    target = out.numpy().view(np.uint8)
    digest = hashlib.sha256()
    offset = 0
    try:
        with open_weights(sha) as body:
            while block := body.read(1 << 20):
                digest.update(block)
                low, high = max(offset, first), min(offset + len(block), last)
                if low < high:
                    target[low - first : high - first] = np.frombuffer(block, np.uint8, high - low, low - offset)
                offset += len(block)
    except OSError as exc:
        raise PretrainedUnavailable(f"pretrained weights {sha[:12]}: cannot download them: {exc}") from None
    if offset != expected:
        raise PretrainedUnavailable(
            f"pretrained weights {sha[:12]}: {offset} bytes came, {expected} expected ({assignment.param_count} "
            "fp32 parameters); the site's copy does not fit the campaign"
        )
    if digest.hexdigest() != sha:
        raise PretrainedUnavailable(f"pretrained weights {sha[:12]}: the bytes that came hash to {digest.hexdigest()}")
    if sys.byteorder == "big":  # the stored vector is little-endian
        return torch.from_numpy(out.numpy().byteswap())
    return out


def _saved_upload(entry: Any, numel: int) -> PendingUpload:
    """A pending upload from a checkpoint's "pending" list; ValueError says what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f"expected a dict, found {type(entry).__name__}")
    lease_id, base, n, grad = (entry.get(k) for k in ("lease_id", "base_version", "num_samples", "grad"))
    if not (_is_int(lease_id) and _is_int(base) and _is_int(n)) or n <= 0:
        raise ValueError(
            f"lease id, base version and sample count must be integers, the count above 0; found "
            f"{lease_id!r:.40}, {base!r:.40}, {n!r:.40}"
        )
    if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or grad.shape != (numel,):
        raise ValueError(f"lease {lease_id}: the gradient is not {numel} fp32 values")
    return PendingUpload(lease_id, base, n, grad)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def make_snapshot(
    campaign_id: int, slice_index: int, version: int, params: torch.Tensor, spool: Spool | None = None
) -> Snapshot:
    """Encode the params once per version; every HTTP GET then serves the same bytes (from ``spool`` if given).

    The ETag carries a random nonce rather than a hash of the bytes (hashing
    megabytes per step is on the critical path): the same version republished
    after a rollback or a restart gets a new tag, which is all caches need.
    """
    # Into the spool straight from the tensor, with no bytes copy first; else a copy (never a view: the
    # parameters change with the next step, a published version never does).
    held = spool.hold_fp32(params) if spool is not None else None
    body = held if isinstance(held, mmap.mmap) else encode_fp32(params)
    return Snapshot(version, body, f'"c{campaign_id}-s{slice_index}-v{version}-{secrets.token_hex(8)}"')


class SliceState:
    """Params, optimizer, pending uploads and recent snapshots of one slice.

    Threading: ``apply_step_`` and ``checkpoint_dict`` run in a worker thread
    (``asyncio.to_thread``); every other method runs on the event loop. The
    caller runs at most one of the thread methods at a time per slice.
    """

    def __init__(
        self,
        assignment: SliceAssignment,
        params: torch.Tensor,
        version: int,
        budget: MemoryBudget,
        optimizer_state: dict[str, Any] | None = None,
        rule: AggregationRule | None = None,
        clip_history: ClipHistory | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.assignment = assignment
        self.budget = budget
        self.spool = spool  # where its snapshots and delta bodies wait; None: in memory
        self._rule = rule  # None: the campaign's (``assignment.aggregation``), which a re-assignment may change
        self.clipped = 0  # contributions clipped since this process took the slice (``/healthz``)
        self.pending: dict[int, PendingUpload] = {}
        self.receiving: set[int] = set()  # leases whose chunks are still arriving
        self.finished: OrderedDict[int, str] = OrderedDict()  # lease id -> "committed" | "dropped"
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self.downloads = DownloadCache(spool=spool)  # checksums and deltas of the snapshots, for GET /params
        self._published = asyncio.Event()
        self.install_(params, version, optimizer_state, clip_history)

    # ------------------------------------------------------------ identity

    @property
    def campaign_id(self) -> int:
        return self.assignment.campaign_id

    @property
    def slice_index(self) -> int:
        return self.assignment.slice_index

    @property
    def numel(self) -> int:
        return self.assignment.end - self.assignment.start

    @property
    def rule(self) -> AggregationRule:
        return self._rule if self._rule is not None else build_rule(self.assignment)

    @property
    def retained_versions(self) -> int:
        """Agents may train on any version in the staleness window, plus one in flight."""
        return retained_versions(self.assignment.staleness)

    # ------------------------------------------------------------ state

    def install_(
        self,
        params: torch.Tensor,
        version: int,
        optimizer_state: dict[str, Any] | None = None,
        clip_history: ClipHistory | None = None,
    ) -> None:
        """Replace params, optimizer and clip history (fresh init, checkpoint load, rollback); publish ``version``.

        Snapshots above ``version`` are dropped: after a rollback they belong to
        a timeline that no longer exists. The clip history is the one saved
        with ``version`` (None: empty, as at the seeded init), so the next step
        clips as it did in the run that reached ``version``.
        """
        if params.shape != (self.numel,):
            raise ValueError(f"params of shape {tuple(params.shape)} do not fit a slice of {self.numel} elements")
        self.param = torch.nn.Parameter(params.to(torch.float32).clone())
        self.optimizer = build_slice_optimizer(self.assignment, self.param)
        if optimizer_state is not None:
            current = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
            self.optimizer.load_state_dict(optimizer_state)
            # The checkpoint carries the old hyperparameters; the assignment's are current.
            for group, fresh in zip(self.optimizer.param_groups, current, strict=True):
                group.update(fresh)
        self.version = version
        self.clip_history = clip_history if clip_history is not None else ClipHistory()
        for v in [v for v in self.snapshots if v >= version]:
            del self.snapshots[v]
        self._publish(make_snapshot(self.campaign_id, self.slice_index, version, self.param.detach(), self.spool))

    def _publish(self, snapshot: Snapshot) -> None:
        self.snapshots[snapshot.version] = snapshot
        while len(self.snapshots) > self.retained_versions:
            self.snapshots.popitem(last=False)
        self.downloads.retain_only_({s.etag for s in self.snapshots.values()})
        # Once a step: what the last one's downloads read of the kept bodies leaves the resident set.
        for kept in self.snapshots.values():
            kept.release_pages()
        self.downloads.release_pages()
        self._published.set()  # wakes downloads waiting for this version
        self._published = asyncio.Event()

    async def wait_for_snapshot(self, version: int, timeout_s: float) -> Snapshot | None:
        """The snapshot of ``version``, waiting up to ``timeout_s`` if it is about to be published.

        The site leases work on the newest committed version, which this slice
        may still be applying: an agent asking for it early gets it the moment
        it exists. Versions further ahead than any commit in flight can be, and
        versions already dropped, are answered (None) at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while version not in self.snapshots and self.version < version <= self.version + self.retained_versions:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._published.wait(), remaining)
            except TimeoutError:
                break
        return self.snapshots.get(version)

    def checkpoint_dict(self, *, with_pending: bool = False) -> dict[str, Any]:
        """A plain dict of the current state for ``torch.save``; loadable with ``weights_only=True``.

        ``with_pending`` adds the uploads no commit has named yet (a graceful
        stop): the step in hand then commits on the restarted process instead
        of being redone. Their tensors are shared, not copied: a pending
        upload's gradient is never changed in place.
        """
        state: dict[str, Any] = {
            "config": to_dict(self.assignment),
            "version": self.version,
            "params": self.param.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
            "clip_history": self.clip_history.to_list(),
        }
        if with_pending:
            state["pending"] = [
                {"lease_id": u.lease_id, "base_version": u.base_version, "num_samples": u.num_samples, "grad": u.grad}
                for _, u in sorted(self.pending.items())
            ]
        return state

    def reinstate_(self, saved: Sequence[Any]) -> list[int]:
        """Hold again the uploads a graceful stop saved with this version; returns the lease ids taken back.

        Each one is checked as a new upload would be (shape, sample count,
        version window, memory budget); one that fails is skipped with a
        warning, and the site redoes its step if a commit names it.
        """
        taken: list[int] = []
        for entry in saved:
            try:
                upload = _saved_upload(entry, self.numel)
                self.check_upload(upload.lease_id, upload.base_version)
            except (UploadRefused, ValueError) as exc:
                logger.warning(
                    "campaign %s slice %s: a saved upload is not taken back: %s",
                    self.campaign_id,
                    self.slice_index,
                    exc,
                )
                continue
            if not self.budget.try_reserve(upload.nbytes):
                logger.warning(
                    "campaign %s slice %s: no memory left to take back saved upload of lease %s",
                    self.campaign_id,
                    self.slice_index,
                    upload.lease_id,
                )
                continue
            if self.spool is not None:  # to the spool, as it would have gone on arrival
                grad, pages = self.spool.keep(upload.grad)
                upload = replace(upload, grad=grad, pages=pages)
            self.pending[upload.lease_id] = upload
            taken.append(upload.lease_id)
        return taken

    # ------------------------------------------------------------ uploads

    def check_upload(self, lease_id: int, base_version: int) -> None:
        """Refuse replays and versions outside the window ``[version - staleness, version]``.

        Raises:
            UploadRefused: with code "replayed upload", "stale version" or "future version".
        """
        if lease_id in self.pending or lease_id in self.receiving or lease_id in self.finished:
            state = self.finished.get(lease_id, "pending")
            raise UploadRefused(
                "replayed upload",
                f"lease {lease_id} already uploaded slice {self.slice_index} ({state}); each lease uploads once",
            )
        low = self.version - self.assignment.staleness
        if base_version < low:
            raise UploadRefused(
                "stale version",
                f"lease {lease_id} trained on version {base_version}, but slice {self.slice_index} is at "
                f"version {self.version} and accepts {low}..{self.version}; ask the site for a new lease",
            )
        if base_version > self.version:
            raise UploadRefused(
                "future version",
                f"lease {lease_id} trained on version {base_version}, but slice {self.slice_index} is only at "
                f"version {self.version}; retry after the site publishes it",
            )

    def check_replay(self, lease_id: int) -> None:
        """Mark a verification copy as receiving, refusing a second upload of it (no version window: see tickets)."""
        if lease_id in self.pending or lease_id in self.receiving or lease_id in self.finished:
            raise UploadRefused(
                "replayed upload",
                f"lease {lease_id} already uploaded slice {self.slice_index}; each lease uploads once",
            )
        self.receiving.add(lease_id)

    def note_checked(self, lease_id: int) -> None:
        """A verification copy was received and sketched; nothing of it is kept but its id (against replays)."""
        self.receiving.discard(lease_id)
        self.finished[lease_id] = "checked"
        self.finished.move_to_end(lease_id)
        while len(self.finished) > MAX_REMEMBERED_LEASES:
            self.finished.popitem(last=False)

    def begin_upload(self, lease_id: int, base_version: int) -> None:
        """Check and mark a lease as receiving, so a concurrent duplicate on another connection is refused."""
        self.check_upload(lease_id, base_version)
        self.receiving.add(lease_id)

    def abort_upload(self, lease_id: int) -> None:
        self.receiving.discard(lease_id)

    def add_pending(self, upload: PendingUpload) -> None:
        """Keep a fully received, validated upload until a commit names it.

        The version window is checked again: a step may have been applied
        while the chunks were arriving. The upload's bytes must already be
        reserved in the budget; from here on this slice releases them.

        Raises:
            UploadRefused: if the upload became stale meanwhile (the caller releases the bytes).
        """
        self.receiving.discard(upload.lease_id)
        self.check_upload(upload.lease_id, upload.base_version)
        self.pending[upload.lease_id] = upload

    def _forget(self, lease_id: int, outcome: str) -> None:
        upload = self.pending.pop(lease_id, None)
        if upload is not None:
            self.budget.release(upload.nbytes)
        self.finished[lease_id] = outcome
        self.finished.move_to_end(lease_id)
        while len(self.finished) > MAX_REMEMBERED_LEASES:
            self.finished.popitem(last=False)

    def drop_stale_(self) -> list[int]:
        """Drop pending uploads no commit can use any more (base version below the window)."""
        low = self.version - self.assignment.staleness
        stale = sorted(lid for lid, up in self.pending.items() if up.base_version < low)
        for lease_id in stale:
            self._forget(lease_id, "dropped")
        if stale:
            logger.debug("campaign %s slice %s dropped stale leases %s", self.campaign_id, self.slice_index, stale)
        return stale

    def drop_newer_(self, version: int) -> list[int]:
        """Drop pending uploads trained on versions above ``version`` (a rollback discards them)."""
        newer = sorted(lid for lid, up in self.pending.items() if up.base_version > version)
        for lease_id in newer:
            self._forget(lease_id, "dropped")
        return newer

    def release_all(self) -> None:
        """Give back the budget of every pending upload (the slice is being unassigned)."""
        for upload in self.pending.values():
            self.budget.release(upload.nbytes)
        self.pending.clear()

    # ------------------------------------------------------------ steps

    def collect(self, lease_ids: Sequence[int], num_samples: int) -> list[PendingUpload]:
        """The pending uploads a commit names, in ascending lease-id order.

        Raises:
            StepRefused: if any lease is missing or the sample counts disagree; nothing changes.
        """
        ordered = sorted(set(lease_ids))
        if len(ordered) != len(lease_ids):
            raise StepRefused(f"commit names a lease twice: {sorted(lease_ids)}")
        if not ordered:
            raise StepRefused("commit names no leases; a step needs at least one")
        missing = [lid for lid in ordered if lid not in self.pending]
        if missing:
            raise StepRefused(
                f"slice {self.slice_index} holds no upload for leases {missing} at version {self.version}",
                missing,
            )
        uploads = [self.pending[lid] for lid in ordered]
        held = sum(u.num_samples for u in uploads)
        if held != num_samples or num_samples <= 0:
            raise StepRefused(
                f"commit says {num_samples} samples but the named uploads carry {held}; "
                "the site and the tickets disagree on lease sizes"
            )
        return uploads

    def apply_step_(self, uploads: Sequence[PendingUpload], num_samples: int) -> Snapshot:
        """Run in a thread: clip and combine the uploads, take one optimizer step at the scheduled rate, encode.

        Returns:
            The snapshot of version ``self.version + 1``; ``finish_step`` publishes it.
        """
        clipping = clip_contributions(uploads, self.clip_history, self.assignment.clip_factor)
        if clipping.clipped:
            logger.info(
                "campaign %s slice %s step %s: clipped leases %s to a norm per sample of %.4g (%g x the median %.4g)",
                self.campaign_id,
                self.slice_index,
                self.version,
                clipping.clipped,
                clipping.bound,
                self.assignment.clip_factor,
                clipping.median,
            )
        grad = self.rule.combine(clipping.uploads, num_samples)
        self.param.grad = grad
        # The schedule is a function of the step index, which is the version: after a restart
        # from a checkpoint of version v the next step runs at the rate of step v again.
        spec = self.assignment.optimizer
        for group in self.optimizer.param_groups:
            group["lr"] = spec.lr * spec.lr_multiplier(self.version)
        self.optimizer.step()  # weight decay included: a pre-hook applies it (see optimizers.py)
        self.param.grad = None
        # Recorded only once the step is taken: a step that raised before leaves the history as it was.
        self.clip_history.record_(clipping.recorded)
        self.clipped += len(clipping.clipped)
        return make_snapshot(self.campaign_id, self.slice_index, self.version + 1, self.param.detach(), self.spool)

    def finish_step(self, snapshot: Snapshot, lease_ids: Sequence[int]) -> list[int]:
        """On the loop, after ``apply_step_``: advance the version, publish, forget used and stale uploads.

        Returns:
            Lease ids dropped as stale.
        """
        self.version = snapshot.version
        self._publish(snapshot)
        for lease_id in lease_ids:
            self._forget(lease_id, "committed")
        return self.drop_stale_()

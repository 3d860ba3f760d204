"""What one aggregator holds (slices, ticket key, memory budget) and how it answers the site's orders."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import torch

from crowdtrain_agent.protocol import (
    REFUSALS_THAT_COUNT,
    CheckpointComplete,
    CheckpointSaved,
    Message,
    Rollback,
    SliceAssignment,
    SliceLost,
    SliceReady,
    SliceUnassign,
    StepApplied,
    StepCommit,
    StepFailed,
    UploadRefused,
)

from .checkpoints import (
    CheckpointError,
    CheckpointStore,
    LocalStore,
    WithFallback,
    delete_versions,
    load_checkpoint,
    save_checkpoint,
    to_prune,
)
from .config import BackboneConfig
from .metrics import BackboneMetrics
from .robust import ClipHistory
from .slices import MemoryBudget, PretrainedUnavailable, SliceState, StepRefused, WeightsOpener, initial_params
from .spool import Spool

logger = logging.getLogger(__name__)
# The first wait before a refused checkpoint is written again, and the longest (doubled after each refusal).
RETRY_FIRST_S = 2.0
# A stalled download of pretrained weights fails after this long without a byte (urllib's socket timeout).
WEIGHTS_TIMEOUT_S = 60.0
RETRY_MAX_S = 10.0

SiteOrder = SliceAssignment | StepCommit | Rollback | SliceUnassign | CheckpointComplete
ORDERS = (SliceAssignment, StepCommit, Rollback, SliceUnassign, CheckpointComplete)  # what ``handle`` carries out
Reply = SliceReady | SliceLost | CheckpointSaved | StepApplied | StepFailed

# Fields that fix which numbers a slice holds; a change means a different slice.
_LAYOUT_FIELDS = ("start", "end", "param_count", "model", "seed", "initial")
# The part of an exception's text a StepFailed or SliceLost carries: the site shows it on the campaign page.
_DETAIL_CHARS = 500
# A step whose uploads hold at most this many elements in all is applied on the event loop, not in a
# worker thread: a few milliseconds of arithmetic, but thousands of small tensor operations, each of which
# gives up the GIL and must win it back from a loop busy with uploads, while the step after next waits on
# it (docs/performance.md, "Small steps on the event loop").
INLINE_STEP_ELEMENTS = 1 << 22


def _same_layout(a: SliceAssignment, b: SliceAssignment) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _LAYOUT_FIELDS)


# Leases whose refusal this aggregator reported, remembered so each is reported once (newest kept).
REFUSED_LEASES_KEPT = 4096


class SliceLostError(RuntimeError):
    """No usable state for the versions the site offered; the message says what was tried."""


def _usable(state: dict[str, Any], assignment: SliceAssignment) -> str | None:
    """Why a loaded checkpoint cannot serve this slice, or None if it can."""
    saved, params = state["config"], state["params"]
    if (
        not isinstance(saved, dict)
        or any(saved.get(f) != getattr(assignment, f) for f in ("start", "end", "param_count"))
        or not isinstance(params, torch.Tensor)
        or params.shape != (assignment.end - assignment.start,)
    ):
        return "it was written for a different slice layout"
    return None


class Restored(NamedTuple):
    """What a slice resumes from: params at ``version``, the optimizer state (None: fresh), saved uploads and
    the clip history saved with ``version`` (None: empty, as at the seeded init)."""

    params: torch.Tensor
    version: int
    optimizer_state: dict[str, Any] | None
    pending: list[Any]
    clip_history: ClipHistory | None = None


def _load(store: CheckpointStore, assignment: SliceAssignment, version: int) -> Restored:
    cid, idx = assignment.campaign_id, assignment.slice_index
    state = load_checkpoint(store, cid, idx, version)
    problem = _usable(state, assignment)
    if problem:
        raise CheckpointError(f"checkpoint v{version} of campaign {cid} slice {idx}: {problem}")
    optimizer_state = state["optimizer"]
    if (state["config"].get("optimizer") or {}).get("name") != assignment.optimizer.name:
        # Moments of another optimizer mean nothing to this one: keep the params, restart its state.
        logger.warning(
            "campaign %s slice %s: the optimizer changed since v%s; its state starts fresh", cid, idx, version
        )
        optimizer_state = None
    pending = state.get("pending")
    try:
        # A checkpoint written before clipping existed has none: the history starts over from its next step.
        history = ClipHistory.from_saved(state.get("clip_history", []))
    except ValueError as exc:
        logger.warning("campaign %s slice %s: checkpoint v%s: %s; it starts empty", cid, idx, version, exc)
        history = ClipHistory()
    return Restored(state["params"], version, optimizer_state, pending if isinstance(pending, list) else [], history)


def _version_zero(assignment: SliceAssignment, open_weights: WeightsOpener | None) -> Restored:
    try:
        return Restored(initial_params(assignment, open_weights), 0, None, [])
    except PretrainedUnavailable as exc:
        raise SliceLostError(str(exc)) from None


def restore(
    assignment: SliceAssignment,
    store: CheckpointStore,
    version: int,
    fallback: int | None,
    open_weights: WeightsOpener | None = None,
) -> Restored:
    """The state to hold: ``version``'s checkpoint, else the site's ``fallback`` (a complete version), else lost.

    Never an older checkpoint of this slice alone (the other slices may not
    have it), and never the seeded init for a campaign that has stepped unless
    the site says so (``fallback`` 0). Uploads saved by a graceful stop come
    back only with ``version`` itself: going back to ``fallback`` means the
    site rolled back, and rejected them. Blocking (storage and model
    construction): call it through ``asyncio.to_thread``.

    Raises:
        SliceLostError: neither version can be loaded.
    """
    cid, idx = assignment.campaign_id, assignment.slice_index
    if version == 0:
        return _version_zero(assignment, open_weights)
    tried = []
    try:
        return _load(store, assignment, version)
    except CheckpointError as exc:
        tried.append(str(exc))
    if fallback is None:
        raise SliceLostError(f"{tried[0]}; the campaign has no complete checkpoint to fall back to")
    if fallback == 0:
        logger.warning("campaign %s slice %s: restarting from version 0, as the site asks", cid, idx)
        return _version_zero(assignment, open_weights)
    try:
        restored = _load(store, assignment, fallback)
    except CheckpointError as exc:
        raise SliceLostError(f"{tried[0]}; and the newest complete checkpoint failed too: {exc}") from exc
    logger.warning(
        "campaign %s slice %s: no checkpoint of version %s, resuming from the newest complete one, version %s",
        cid,
        idx,
        version,
        fallback,
    )
    return restored._replace(pending=[])


def _give_back_freed_memory() -> None:
    """Return to the system what glibc's allocator keeps of memory already freed (``malloc_trim``).

    Building version 0 builds the whole model to keep a slice of it; at 100M
    parameters its freed pieces stayed in the allocator's per-thread heaps,
    about 370 MB of an aggregator's resident memory for good. Nothing where
    the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class AggregatorNode:
    """The slices this process holds, keyed by (campaign id, slice index).

    The site link calls ``handle`` for one campaign at a time, in the order the
    site sent the orders; upload handlers read ``slices`` and ``campaign_key``.
    """

    def __init__(self, config: BackboneConfig, store: CheckpointStore | None = None) -> None:
        self.config = config
        store = store if store is not None else config.checkpoint_store(os.environ)
        if config.checkpoint_fallback_dir is not None:
            store = WithFallback(store, LocalStore(config.checkpoint_fallback_dir))
        self.store: CheckpointStore = store
        # Slices whose last checkpoint the store refused: (when to try again, the wait after that). Each is
        # written again at its current version until the store takes it, so that the site's newest complete
        # version moves on again by itself once storage is back (``retry_checkpoints``).
        self.owed: dict[tuple[int, int], tuple[float, float]] = {}
        self.budget = MemoryBudget(config.max_pending_bytes)
        self.spool = Spool(config.spool_dir, config.spool_min_bytes)
        self.metrics = BackboneMetrics(self)
        self.slices: dict[tuple[int, int], SliceState] = {}
        self.complete: dict[int, list[int]] = {}  # per campaign: versions every slice has a checkpoint of
        self.saved: dict[tuple[int, int], int] = {}  # per slice: the version of its newest checkpoint here
        # The welcome's key: a 2.0 site's one key for every campaign, b"" from a 2.1 site (each campaign's
        # key comes with its slices). None until the welcome; uploads wait for it.
        self.ticket_key: bytes | None = None
        self.aggregator_id: int | None = None
        # The protocol minor of the site connection: receipts carry gradient sketches from 2.2 on (a 2.1
        # site would not recognise such a receipt).
        self.site_minor = 0
        # How a message reaches the site outside a reply (the site link sets it while connected).
        self.tell_site: Callable[[Message], None] | None = None
        self._refused_leases: OrderedDict[int, None] = OrderedDict()  # the newest leases reported refused
        # Slices whose optimizer step raised, with what the site was told. A step that failed half-way may
        # have changed the params or the moments already: such a slice applies no commit (a retry could apply
        # part of a step twice) until an assignment or a rollback reloads it from a checkpoint.
        self.broken: dict[tuple[int, int], str] = {}
        # Per campaign: the newest timeline (its rollbacks so far) an assignment, a rollback or a commit
        # named. A commit of an older one was written before a rollback that this process has carried out.
        self.timelines: dict[int, int] = {}

    def open_weights(self, sha256: str) -> IO[bytes]:
        """The site's stream of the pretrained weights a campaign starts from (``slices.pretrained_slice``).

        Raises:
            OSError: the site cannot be reached or refuses (urllib's errors are OSErrors).
        """
        request = urllib.request.Request(
            f"{self.config.site.rstrip('/')}/api/backbone/weights/{sha256}",
            headers={"Authorization": f"Bearer {self.config.token}", "User-Agent": "crowdtrain-backbone"},
        )
        response: IO[bytes] = urllib.request.urlopen(request, timeout=WEIGHTS_TIMEOUT_S)
        return response

    def _note_timeline(self, campaign_id: int, timeline: int) -> None:
        self.timelines[campaign_id] = max(self.timelines.get(campaign_id, 0), timeline)

    def note_refusal(
        self, campaign_id: int | None, lease_id: int | None, slice_index: int | None, code: str, detail: str
    ) -> None:
        """Tell the site of an upload refused for its content (``REFUSALS_THAT_COUNT``): it counts against its agent."""
        if code not in REFUSALS_THAT_COUNT or campaign_id is None or lease_id is None or slice_index is None:
            return
        if lease_id in self._refused_leases:
            return  # a lease's refusals count once on the site: a retried header need not cost it a message
        self._refused_leases[lease_id] = None
        if len(self._refused_leases) > REFUSED_LEASES_KEPT:
            self._refused_leases.popitem(last=False)
        if self.tell_site is not None:
            message = UploadRefused(
                campaign_id=campaign_id, lease_id=lease_id, slice_index=slice_index, code=code, detail=detail[:8192]
            )
            self.tell_site(message)

    def get_slice(self, campaign_id: int, slice_index: int) -> SliceState | None:
        return self.slices.get((campaign_id, slice_index))

    def campaign_key(self, campaign_id: int) -> bytes | None:
        """The key that checks this campaign's tickets and signs its receipts; None without a slice of it.

        A 2.1 site sends each campaign's own key with its slices, a 2.0 site one key in its welcome.
        """
        for (cid, _), state in self.slices.items():
            if cid == campaign_id:
                own = state.assignment.ticket_key
                return bytes.fromhex(own) if own else (self.ticket_key or None)
        return None

    def campaign_slices(self, campaign_id: int) -> list[SliceState]:
        return [s for (cid, _), s in sorted(self.slices.items()) if cid == campaign_id]

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` shows: enough for an operator to see what this node holds."""
        return {
            "name": self.config.name,
            "aggregator_id": self.aggregator_id,
            "pending_bytes": self.budget.used,
            "slices": [
                {
                    "campaign_id": s.campaign_id,
                    "slice_index": s.slice_index,
                    "start": s.assignment.start,
                    "end": s.assignment.end,
                    "version": s.version,
                    "versions": list(s.snapshots),
                    "pending_leases": sorted(s.pending),
                    "aggregation": s.rule.name,
                    "clipped": s.clipped,
                }
                for s in self.slices.values()
            ],
        }

    async def handle(self, order: SiteOrder) -> list[Reply]:
        """Carry out one order from the site and return the replies to send back.

        Args:
            order: an assignment, commit, rollback or unassign.

        Returns:
            SliceReady / StepApplied / StepFailed messages, one per slice concerned.
        """
        if isinstance(order, SliceAssignment):
            self._note_timeline(order.campaign_id, order.timeline)
            return [await self.assign(order)]
        if isinstance(order, StepCommit):
            if order.timeline < self.timelines.get(order.campaign_id, 0):
                # Overtaken by a rollback this process carried out: the site discarded that step, and
                # its index may belong to a redone step by now. Applying it would count its samples twice.
                logger.warning(
                    "campaign %s: dropped the commit of step %s from timeline %s, which a rollback ended (now %s)",
                    order.campaign_id,
                    order.step,
                    order.timeline,
                    self.timelines[order.campaign_id],
                )
                return []
            self._note_timeline(order.campaign_id, order.timeline)
            return await self.commit(order)
        if isinstance(order, Rollback):
            self._note_timeline(order.campaign_id, order.timeline)
            return await self.rollback(order)
        if isinstance(order, CheckpointComplete):
            await self.note_complete(order)
            return []
        if isinstance(order, SliceUnassign):
            self.unassign(order)
            return []
        raise TypeError(f"no handler for {type(order).__name__}; add it to AggregatorNode.handle and ORDERS")

    async def assign(self, assignment: SliceAssignment) -> SliceReady | SliceLost:
        """Take (or re-take) a slice and load the state for the site's current version."""
        key = (assignment.campaign_id, assignment.slice_index)
        current = self.slices.get(key)
        if current is not None and _same_layout(current.assignment, assignment):
            previous, current.assignment = current.assignment, assignment  # staleness, norm bound... may change
            if previous.optimizer != assignment.optimizer:
                # New hyperparameters apply from the next step; moments survive unless the optimizer kind changed.
                same_kind = previous.optimizer.name == assignment.optimizer.name
                kept = current.optimizer.state_dict() if same_kind else None
                current.install_(current.param.detach(), current.version, kept, current.clip_history)
            if key in self.broken:
                logger.info("campaign %s slice %s re-assigned after a failed step: reloading it", *key)
                return await self._reload(current, assignment.version, assignment.restore_version)
            if current.version >= assignment.version:
                # Ahead is normal: the site's version is the slowest slice's. Reloading would throw
                # away applied steps whose uploads are gone; say where we are and let the site decide.
                logger.info("campaign %s slice %s re-assigned at version %s", *key, current.version)
                return SliceReady(campaign_id=key[0], slice_index=key[1], version=current.version)
            return await self._reload(current, assignment.version, assignment.restore_version)
        if current is not None:
            logger.warning("campaign %s slice %s re-assigned with a new layout; dropping the old one", *key)
            self.slices.pop(key).release_all()
            self.broken.pop(key, None)
        try:
            restored = await asyncio.to_thread(
                restore, assignment, self.store, assignment.version, assignment.restore_version, self.open_weights
            )
        except SliceLostError as exc:
            return self._lost(assignment, assignment.version, str(exc))
        finally:
            _give_back_freed_memory()
        version = restored.version
        state = SliceState(
            assignment,
            restored.params,
            version,
            self.budget,
            restored.optimizer_state,
            clip_history=restored.clip_history,
            spool=self.spool,
        )
        # A graceful stop saved the uploads of the step in hand: with them that step commits here.
        taken = state.reinstate_(restored.pending)
        self.slices[key] = state
        await asyncio.to_thread(self._owe_unless_stored, state)
        await asyncio.to_thread(self._forget_newer, state)
        logger.info(
            "holding campaign %s slice %s (elements %s:%s) at version %s%s",
            *key,
            assignment.start,
            assignment.end,
            version,
            f", with {len(taken)} pending uploads saved at the stop" if taken else "",
        )
        return SliceReady(campaign_id=key[0], slice_index=key[1], version=version)

    def _lost(self, assignment: SliceAssignment, version: int, detail: str) -> SliceLost:
        key = (assignment.campaign_id, assignment.slice_index)
        dropped = self.slices.pop(key, None)
        if dropped is not None:
            dropped.release_all()
        self.broken.pop(key, None)
        logger.error("campaign %s slice %s is lost: %s", *key, detail)
        return SliceLost(campaign_id=key[0], slice_index=key[1], version=version, detail=detail)

    async def _reload(self, state: SliceState, version: int, fallback: int | None) -> SliceReady | SliceLost:
        try:
            restored = await asyncio.to_thread(
                restore, state.assignment, self.store, version, fallback, self.open_weights
            )
        except SliceLostError as exc:
            return self._lost(state.assignment, version, str(exc))
        # Uploads saved in the file are not taken back: this process's own pending ones are newer.
        loaded = restored.version
        state.install_(restored.params, loaded, restored.optimizer_state, restored.clip_history)
        self.broken.pop((state.campaign_id, state.slice_index), None)
        dropped = state.drop_newer_(loaded)
        removed = await asyncio.to_thread(self._forget_newer, state)
        logger.info(
            "campaign %s slice %s now at version %s (dropped pending leases %s, checkpoints %s)",
            state.campaign_id,
            state.slice_index,
            loaded,
            dropped,
            removed,
        )
        return SliceReady(campaign_id=state.campaign_id, slice_index=state.slice_index, version=loaded)

    def _owe_unless_stored(self, state: SliceState) -> None:
        """A slice resumed from its fallback copy (the store was away): the store still owes the site that version."""
        if not isinstance(self.store, WithFallback) or state.version == 0:
            return
        key = (state.campaign_id, state.slice_index)
        if not self.store.stored(*key, state.version):
            self.owed[key] = (time.monotonic(), RETRY_FIRST_S / 2)

    def _forget_newer(self, state: SliceState) -> list[int]:
        """Delete this slice's checkpoints above its version: a timeline that a restore or rollback ended."""
        key = (state.campaign_id, state.slice_index)
        try:
            newer = [v for v in self.store.versions(*key) if v > state.version]
        except Exception as exc:
            logger.warning("cannot list the checkpoints of campaign %s slice %s: %s", *key, exc)
            return []
        if self.saved.get(key, -1) > state.version:
            del self.saved[key]
        return delete_versions(self.store, *key, newer)

    async def commit(self, commit: StepCommit) -> list[Reply]:
        """Apply step ``commit.step`` to every slice of the campaign held here."""
        slices = self.campaign_slices(commit.campaign_id)
        if not slices:
            logger.warning("commit for campaign %s, which holds no slice here", commit.campaign_id)
            return [
                StepFailed(
                    campaign_id=commit.campaign_id,
                    slice_index=-1,
                    step=commit.step,
                    detail=f"aggregator {self.config.name} holds no slice of campaign {commit.campaign_id}; "
                    "assign the slices first",
                )
            ]
        replies: list[Reply] = []
        for state in slices:
            replies += await self._commit_slice(state, commit)
        return replies

    async def _commit_slice(self, state: SliceState, commit: StepCommit) -> list[Reply]:
        cid, idx = state.campaign_id, state.slice_index
        broken = self.broken.get((cid, idx))
        if broken is not None and commit.step == state.version:
            # The site sent it again before it heard (or after it reconnected): the same answer, no second try.
            return [StepFailed(campaign_id=cid, slice_index=idx, step=commit.step, detail=broken)]
        if commit.step < state.version:
            # The site re-sent a commit we already applied (it reconnected): same answer again.
            logger.debug("campaign %s slice %s: duplicate commit of step %s", cid, idx, commit.step)
            return [StepApplied(campaign_id=cid, slice_index=idx, step=commit.step, version=commit.step + 1)]
        if commit.step > state.version:
            return [
                StepFailed(
                    campaign_id=cid,
                    slice_index=idx,
                    step=commit.step,
                    detail=f"slice {idx} is at version {state.version}, commit is for step {commit.step}; "
                    "roll back or re-assign the slice",
                )
            ]
        try:
            uploads = state.collect(commit.lease_ids, commit.num_samples)
        except StepRefused as exc:
            logger.warning("campaign %s slice %s cannot apply step %s: %s", cid, idx, commit.step, exc.detail)
            return [
                StepFailed(
                    campaign_id=cid, slice_index=idx, step=commit.step, missing_lease_ids=exc.missing, detail=exc.detail
                )
            ]
        try:
            started = time.perf_counter()
            large = len(uploads) * state.param.numel() > INLINE_STEP_ELEMENTS
            if not large:
                snapshot = state.apply_step_(uploads, commit.num_samples)
            else:  # off the event loop: uploads and heartbeats keep flowing while the optimizer runs
                snapshot = await asyncio.to_thread(state.apply_step_, uploads, commit.num_samples)
            dropped = state.finish_step(snapshot, commit.lease_ids)
            if large:  # what the step's passes, the uploads' chunks and the downloads' parts left in the heaps
                _give_back_freed_memory()
        except Exception as exc:  # a torch error, out of memory, a bug: the site must hear, or it waits for ever
            return [self._could_not_apply(state, commit.step, exc)]
        self.metrics.step_applied(cid, idx, time.perf_counter() - started)
        logger.info(
            "campaign %s slice %s applied step %s (%s leases, %s samples, %s stale dropped)",
            cid,
            idx,
            commit.step,
            len(uploads),
            commit.num_samples,
            len(dropped),
            extra={"campaign_id": cid, "slice_index": idx, "step": commit.step},
        )
        replies: list[Reply] = [StepApplied(campaign_id=cid, slice_index=idx, step=commit.step, version=state.version)]
        every = state.assignment.checkpoint_every
        if every > 0 and state.version % every == 0:
            saved = await self.checkpoint(state)
            if saved is not None:
                replies.append(saved)
        return replies

    def _could_not_apply(self, state: SliceState, step: int, exc: BaseException) -> StepFailed:
        """Mark the slice broken and tell the site why, in words an organizer can act on."""
        key = (state.campaign_id, state.slice_index)
        detail = f"slice {key[1]} could not apply step {step}: {type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
        self.broken[key] = detail
        logger.error(
            "campaign %s slice %s could not apply step %s; it applies no commit until the site assigns it again "
            "or rolls it back (both reload it from a checkpoint)",
            *key,
            step,
            exc_info=exc,
        )
        return StepFailed(campaign_id=key[0], slice_index=key[1], step=step, detail=detail)

    def failure_replies(self, order: SiteOrder, exc: BaseException) -> list[Reply]:
        """What to answer an order whose handling raised (``handle`` itself, not a step it caught).

        A site that hears nothing waits, and re-sends a commit on every heartbeat: each
        slice the order left unfinished reports the error instead. A failed commit marks
        its slices broken; a failed assignment or rollback loses the slice, which blocks
        the campaign until an operator restores it.
        """
        what = f"{type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
        if isinstance(order, StepCommit):
            return [
                self._could_not_apply(state, order.step, exc)
                for state in self.campaign_slices(order.campaign_id)
                if state.version == order.step
            ]
        if isinstance(order, SliceAssignment):
            return [self._lost(order, order.version, f"could not take the slice: {what}")]
        if isinstance(order, Rollback):
            return [
                self._lost(state.assignment, order.version, f"could not roll back to version {order.version}: {what}")
                for state in self.campaign_slices(order.campaign_id)
            ]
        return []

    async def checkpoint(self, state: SliceState, *, with_pending: bool = False) -> CheckpointSaved | None:
        """Write the slice's checkpoint of its current version and prune old ones; None if it failed.

        A failure never stops training (the step is applied already); the
        site then has no complete checkpoint of this version, and rollbacks
        go to an older one. ``with_pending``: see ``SliceState.checkpoint_dict``.
        """
        key = (state.campaign_id, state.slice_index)
        version = state.version
        # On the loop: the next step cannot change it while it is written.
        snapshot = state.checkpoint_dict(with_pending=with_pending)

        def write() -> None:
            save_checkpoint(self.store, *key, version, snapshot)
            self.saved[key] = version
            delete_versions(
                self.store, *key, to_prune(self.store.versions(*key), version, self.complete.get(key[0], []))
            )

        try:
            await asyncio.to_thread(write)
        except CheckpointError as exc:
            wait = min(RETRY_MAX_S, 2 * self.owed.get(key, (0.0, RETRY_FIRST_S / 2))[1])
            self.owed[key] = (time.monotonic() + wait, wait)
            self.metrics.checkpoint_failed(*key)
            logger.error(
                "campaign %s slice %s: %s; the step itself was applied. Check the space and permissions of %s; "
                "writing the slice again in %.0f s",
                *key,
                exc,
                self.store.describe(),
                wait,
            )
            return None
        except Exception as exc:  # listing or pruning failed after a good write: the checkpoint stands
            logger.warning("campaign %s slice %s: checkpoint v%s written, pruning failed: %s", *key, version, exc)
        self.owed.pop(key, None)
        return CheckpointSaved(campaign_id=key[0], slice_index=key[1], version=version)

    async def retry_checkpoints(self) -> list[Reply]:
        """Write again, at its current version, each slice whose checkpoint the store refused and whose wait is over.

        While the store is away the site's newest complete version stands still and,
        past its bound, the campaign stops committing (every slice then stays at one
        version): writing that version again is what lets it go on by itself.
        """
        replies: list[Reply] = []
        now = time.monotonic()
        for key, (due, _) in sorted(self.owed.items()):
            state = self.slices.get(key)
            if state is None:
                del self.owed[key]
            elif due <= now:
                saved = await self.checkpoint(state)
                if saved is not None:
                    logger.info("campaign %s slice %s: the store takes checkpoints again (v%s)", *key, saved.version)
                    replies.append(saved)
        return replies

    async def checkpoint_all(self) -> list[Reply]:
        """A checkpoint of every slice at its current version, with its pending uploads (before a graceful exit).

        The uploads make the difference between a stop that costs nothing and
        one that redoes the step in hand: agents hold receipts for them, and the
        site commits them as soon as the step is full.
        """
        replies: list[Reply] = []
        for key, state in sorted(self.slices.items()):
            if self.saved.get(key) == state.version and not state.pending:
                replies.append(CheckpointSaved(campaign_id=key[0], slice_index=key[1], version=state.version))
                continue
            saved = await self.checkpoint(state, with_pending=True)
            if saved is not None:
                replies.append(saved)
        return replies

    async def note_complete(self, order: CheckpointComplete) -> None:
        """Remember which versions the site can restore every slice to, and prune with that in mind."""
        self.complete[order.campaign_id] = sorted(order.versions)
        for state in self.campaign_slices(order.campaign_id):
            key = (state.campaign_id, state.slice_index)

            def prune(key: tuple[int, int] = key, current: int = state.version) -> None:
                delete_versions(self.store, *key, to_prune(self.store.versions(*key), current, order.versions))

            try:
                await asyncio.to_thread(prune)
            except Exception as exc:
                logger.warning("campaign %s slice %s: pruning checkpoints failed: %s", *key, exc)

    async def rollback(self, order: Rollback) -> list[Reply]:
        """Go back to the checkpoint of ``order.version`` and forget everything newer."""
        replies: list[Reply] = []
        for state in self.campaign_slices(order.campaign_id):
            if state.version == order.version and (state.campaign_id, state.slice_index) not in self.broken:
                state.drop_newer_(order.version)  # already there; memory is as good as the checkpoint
                await asyncio.to_thread(self._forget_newer, state)
                replies.append(
                    SliceReady(campaign_id=state.campaign_id, slice_index=state.slice_index, version=state.version)
                )
            else:
                # The site rolls back only to versions every slice confirmed a checkpoint of (a broken
                # slice at that version reloads it too: its memory may hold half a step).
                replies.append(await self._reload(state, order.version, None))
        if not replies:
            logger.warning("rollback for campaign %s, which holds no slice here", order.campaign_id)
        return replies

    def unassign(self, order: SliceUnassign) -> None:
        """Drop every slice of the campaign and give back its pending memory."""
        for state in self.campaign_slices(order.campaign_id):
            state.release_all()
            del self.slices[(state.campaign_id, state.slice_index)]
            self.broken.pop((state.campaign_id, state.slice_index), None)
            logger.info("dropped campaign %s slice %s", state.campaign_id, state.slice_index)

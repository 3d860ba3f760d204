"""What one aggregator holds (slices, ticket key, memory budget) and how it answers the site's orders."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch
from crowdtrain_agent.protocol import (
    Rollback,
    SliceAssignment,
    SliceReady,
    SliceUnassign,
    StepApplied,
    StepCommit,
    StepFailed,
)

from .checkpoints import CheckpointError, delete_newer, list_versions, load_checkpoint, save_checkpoint
from .config import BackboneConfig
from .slices import MemoryBudget, SliceState, StepRefused, initial_params

logger = logging.getLogger(__name__)

SiteOrder = SliceAssignment | StepCommit | Rollback | SliceUnassign
Reply = SliceReady | StepApplied | StepFailed

# Fields that fix which numbers a slice holds; a change means a different slice.
_LAYOUT_FIELDS = ("start", "end", "param_count", "model", "seed")


def _same_layout(a: SliceAssignment, b: SliceAssignment) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _LAYOUT_FIELDS)


def restore(
    assignment: SliceAssignment, root: Path, version: int
) -> tuple[torch.Tensor, int, dict[str, Any] | None]:
    """Find the state to hold for ``version``: its checkpoint, else the newest one below, else the seeded init.

    Blocking (disk and model construction): call it through ``asyncio.to_thread``.

    Returns:
        params, the version they are at, and the optimizer state (None for a fresh init).
    """
    cid, idx = assignment.campaign_id, assignment.slice_index
    for v in reversed([v for v in list_versions(root, cid, idx) if v <= version]):
        try:
            state = load_checkpoint(root, cid, idx, v)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint: %s", exc)
            continue
        saved, params = state["config"], state["params"]
        layout = ("start", "end", "param_count")
        if (
            not isinstance(saved, dict)
            or any(saved.get(f) != getattr(assignment, f) for f in layout)
            or not isinstance(params, torch.Tensor)
            or params.shape != (assignment.end - assignment.start,)
        ):
            logger.warning(
                "skipping checkpoint v%s of campaign %s slice %s: it was written for a different slice layout",
                v, cid, idx,
            )  # fmt: skip
            continue
        optimizer_state = state["optimizer"]
        if (saved.get("optimizer") or {}).get("name") != assignment.optimizer.name:
            # Moments of another optimizer mean nothing to this one: keep the params, restart its state.
            logger.warning("campaign %s slice %s: the optimizer changed since v%s; its state starts fresh", cid, idx, v)
            optimizer_state = None
        if v != version:
            logger.warning(
                "campaign %s slice %s: no checkpoint of version %s, resuming from version %s", cid, idx, version, v
            )
        return params, v, optimizer_state
    if version > 0:
        logger.warning(
            "campaign %s slice %s: no checkpoint at or below version %s in %s; starting from the seeded init "
            "(version 0)", cid, idx, version, root,
        )  # fmt: skip
    return initial_params(assignment), 0, None


class AggregatorNode:
    """The slices this process holds, keyed by (campaign id, slice index).

    The site link calls ``handle`` for one campaign at a time, in the order the
    site sent the orders; upload handlers read ``slices`` and ``ticket_key``.
    """

    def __init__(self, config: BackboneConfig) -> None:
        self.config = config
        self.budget = MemoryBudget(config.max_pending_bytes)
        self.slices: dict[tuple[int, int], SliceState] = {}
        self.ticket_key: bytes | None = None  # set by the site's welcome; uploads wait for it
        self.aggregator_id: int | None = None

    def get_slice(self, campaign_id: int, slice_index: int) -> SliceState | None:
        return self.slices.get((campaign_id, slice_index))

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
            return [await self.assign(order)]
        if isinstance(order, StepCommit):
            return await self.commit(order)
        if isinstance(order, Rollback):
            return await self.rollback(order)
        self.unassign(order)
        return []

    async def assign(self, assignment: SliceAssignment) -> SliceReady:
        """Take (or re-take) a slice and load the state for the site's current version."""
        key = (assignment.campaign_id, assignment.slice_index)
        current = self.slices.get(key)
        if current is not None and _same_layout(current.assignment, assignment):
            previous, current.assignment = current.assignment, assignment  # staleness, norm bound... may change
            if previous.optimizer != assignment.optimizer:
                # New hyperparameters apply from the next step; moments survive unless the optimizer kind changed.
                same_kind = previous.optimizer.name == assignment.optimizer.name
                kept = current.optimizer.state_dict() if same_kind else None
                current.install_(current.param.detach(), current.version, kept)
            if current.version >= assignment.version:
                # Ahead is normal: the site's version is the slowest slice's. Reloading would throw
                # away applied steps whose uploads are gone; say where we are and let the site decide.
                logger.info("campaign %s slice %s re-assigned at version %s", *key, current.version)
                return SliceReady(campaign_id=key[0], slice_index=key[1], version=current.version)
            await self._reload(current, assignment.version)
            return SliceReady(campaign_id=key[0], slice_index=key[1], version=current.version)
        if current is not None:
            logger.warning("campaign %s slice %s re-assigned with a new layout; dropping the old one", *key)
            self.slices.pop(key).release_all()
        params, version, optimizer_state = await asyncio.to_thread(
            restore, assignment, self.config.checkpoint_dir, assignment.version
        )
        state = SliceState(assignment, params, version, self.budget, optimizer_state)
        self.slices[key] = state
        logger.info(
            "holding campaign %s slice %s (elements %s:%s) at version %s",
            *key, assignment.start, assignment.end, version,
        )  # fmt: skip
        return SliceReady(campaign_id=key[0], slice_index=key[1], version=version)

    async def _reload(self, state: SliceState, version: int) -> None:
        params, loaded, optimizer_state = await asyncio.to_thread(
            restore, state.assignment, self.config.checkpoint_dir, version
        )
        state.install_(params, loaded, optimizer_state)
        dropped = state.drop_newer_(loaded)
        removed = delete_newer(self.config.checkpoint_dir, state.campaign_id, state.slice_index, loaded)
        logger.info(
            "campaign %s slice %s now at version %s (dropped pending leases %s, checkpoints %s)",
            state.campaign_id, state.slice_index, loaded, dropped, removed,
        )  # fmt: skip

    async def commit(self, commit: StepCommit) -> list[Reply]:
        """Apply step ``commit.step`` to every slice of the campaign held here."""
        slices = self.campaign_slices(commit.campaign_id)
        if not slices:
            logger.warning("commit for campaign %s, which holds no slice here", commit.campaign_id)
            return [
                StepFailed(
                    campaign_id=commit.campaign_id, slice_index=-1, step=commit.step,
                    detail=f"aggregator {self.config.name} holds no slice of campaign {commit.campaign_id}; "
                    "assign the slices first",
                )  # fmt: skip
            ]
        return [await self._commit_slice(state, commit) for state in slices]

    async def _commit_slice(self, state: SliceState, commit: StepCommit) -> Reply:
        cid, idx = state.campaign_id, state.slice_index
        if commit.step < state.version:
            # The site re-sent a commit we already applied (it reconnected): same answer again.
            logger.debug("campaign %s slice %s: duplicate commit of step %s", cid, idx, commit.step)
            return StepApplied(campaign_id=cid, slice_index=idx, step=commit.step, version=commit.step + 1)
        if commit.step > state.version:
            return StepFailed(
                campaign_id=cid, slice_index=idx, step=commit.step,
                detail=f"slice {idx} is at version {state.version}, commit is for step {commit.step}; "
                "roll back or re-assign the slice",
            )  # fmt: skip
        try:
            uploads = state.collect(commit.lease_ids, commit.num_samples)
        except StepRefused as exc:
            logger.warning("campaign %s slice %s cannot apply step %s: %s", cid, idx, commit.step, exc.detail)
            return StepFailed(
                campaign_id=cid, slice_index=idx, step=commit.step, missing_lease_ids=exc.missing, detail=exc.detail
            )
        # Off the event loop: uploads and heartbeats keep flowing while the optimizer runs.
        snapshot = await asyncio.to_thread(state.apply_step_, uploads, commit.num_samples)
        dropped = state.finish_step(snapshot, commit.lease_ids)
        every = state.assignment.checkpoint_every
        if every > 0 and state.version % every == 0:
            await self._checkpoint(state)
        logger.info(
            "campaign %s slice %s applied step %s (%s leases, %s samples, %s stale dropped)",
            cid, idx, commit.step, len(uploads), commit.num_samples, len(dropped),
        )  # fmt: skip
        return StepApplied(campaign_id=cid, slice_index=idx, step=commit.step, version=state.version)

    async def _checkpoint(self, state: SliceState) -> None:
        def write() -> None:
            save_checkpoint(
                self.config.checkpoint_dir, state.campaign_id, state.slice_index, state.version,
                state.checkpoint_dict(),
            )  # fmt: skip

        try:
            await asyncio.to_thread(write)
        except OSError:
            # Training can go on; the site's coordinated checkpoint will be missing this slice.
            logger.exception(
                "cannot write checkpoint of campaign %s slice %s under %s; check the disk and permissions",
                state.campaign_id, state.slice_index, self.config.checkpoint_dir,
            )  # fmt: skip

    async def rollback(self, order: Rollback) -> list[Reply]:
        """Go back to the checkpoint of ``order.version`` and forget everything newer."""
        replies: list[Reply] = []
        for state in self.campaign_slices(order.campaign_id):
            if state.version == order.version:
                state.drop_newer_(order.version)  # already there; memory is as good as the checkpoint
            else:
                await self._reload(state, order.version)
            replies.append(
                SliceReady(campaign_id=state.campaign_id, slice_index=state.slice_index, version=state.version)
            )
        if not replies:
            logger.warning("rollback for campaign %s, which holds no slice here", order.campaign_id)
        return replies

    def unassign(self, order: SliceUnassign) -> None:
        """Drop every slice of the campaign and give back its pending memory."""
        for state in self.campaign_slices(order.campaign_id):
            state.release_all()
            del self.slices[(state.campaign_id, state.slice_index)]
            logger.info("dropped campaign %s slice %s", state.campaign_id, state.slice_index)

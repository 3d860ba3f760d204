"""Slice checkpoints on disk: plain dicts with the assignment, the version, params and optimizer state."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# How many checkpoints of one slice stay on disk. A rollback goes to the
# site's last *coordinated* checkpoint, which is always among the newest few.
KEEP_CHECKPOINTS = 3

_NAME = re.compile(r"^v(\d{8,})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be used for this slice."""


def slice_dir(root: Path, campaign_id: int, slice_index: int) -> Path:
    """The folder holding one slice's checkpoints; the layout is part of the deployment contract."""
    return root / f"campaign-{campaign_id}" / f"slice-{slice_index}"


def checkpoint_path(root: Path, campaign_id: int, slice_index: int, version: int) -> Path:
    """Where the checkpoint of ``version`` lives: ``campaign-{id}/slice-{index}/v{version:08d}.pt``."""
    return slice_dir(root, campaign_id, slice_index) / f"v{version:08d}.pt"


def list_versions(root: Path, campaign_id: int, slice_index: int) -> list[int]:
    """Versions with a checkpoint on disk for this slice, ascending."""
    folder = slice_dir(root, campaign_id, slice_index)
    if not folder.is_dir():
        return []
    versions = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            versions.append(int(match.group(1)))
    return sorted(versions)


def save_checkpoint(root: Path, campaign_id: int, slice_index: int, version: int, state: dict[str, Any]) -> Path:
    """Write a checkpoint atomically, then prune old ones.

    The file is written next to its final name and moved into place with
    ``os.replace``, so a crash mid-write never leaves a truncated ``v*.pt``
    that a restart would try to load.

    Args:
        root: the checkpoint folder from the config.
        campaign_id: campaign of the slice.
        slice_index: index of the slice.
        version: the parameter version the state holds.
        state: a plain dict (config, version, params, optimizer) of tensors and primitives.

    Returns:
        The final path.
    """
    path = checkpoint_path(root, campaign_id, slice_index, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in list_versions(root, campaign_id, slice_index)[:-KEEP_CHECKPOINTS]:
        checkpoint_path(root, campaign_id, slice_index, old).unlink(missing_ok=True)
    logger.info("checkpoint of campaign %s slice %s version %s written to %s", campaign_id, slice_index, version, path)
    return path


def load_checkpoint(root: Path, campaign_id: int, slice_index: int, version: int) -> dict[str, Any]:
    """Read one checkpoint with ``weights_only=True`` (no pickled code runs).

    Raises:
        CheckpointError: if the file is unreadable or not a slice checkpoint.
    """
    path = checkpoint_path(root, campaign_id, slice_index, version)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises a zoo of types for corrupt files
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or not {"config", "version", "params", "optimizer"} <= set(state):
        raise CheckpointError(f"{path} is not a Crowdtrain slice checkpoint (keys: {sorted(state)[:8]})")
    if state["version"] != version:
        raise CheckpointError(f"{path} holds version {state['version']}, not {version}")
    return state


def delete_newer(root: Path, campaign_id: int, slice_index: int, version: int) -> list[int]:
    """Remove checkpoints above ``version`` (after a rollback they belong to a timeline that no longer exists).

    Returns:
        The versions removed.
    """
    removed = [v for v in list_versions(root, campaign_id, slice_index) if v > version]
    for v in removed:
        checkpoint_path(root, campaign_id, slice_index, v).unlink(missing_ok=True)
    return removed

"""Slice checkpoints in storage that outlives the aggregator's machine: a folder, or an S3-compatible bucket.

A checkpoint is one object per (campaign, slice, version), a plain dict
(assignment, version, params, optimizer state) saved with ``torch.save`` and
read back with ``weights_only=True``. Keys are the deployment contract:
``campaign-{id}/slice-{index}/v{version:08d}.pt`` under the folder or the
bucket's prefix. Any aggregator given the same location, on any machine,
restores any slice from it: that is what makes a replacement for a machine
that never comes back start where the old one stopped.

Which versions may be restored is the site's decision (a version is
*complete* when every slice of the campaign confirmed its checkpoint), so
pruning never deletes the newest complete versions this slice has heard of.
"""

from __future__ import annotations

import io
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

# Pruning keeps the newest KEEP_RECENT checkpoints of the current timeline and the newest
# KEEP_COMPLETE complete ones (an operator may choose the older of those after a loss).
KEEP_RECENT = 2
KEEP_COMPLETE = 2

_NAME = re.compile(r"^v(\d{8,})\.pt$")
_STATE_KEYS = {"config", "version", "params", "optimizer"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used; the message names it and the cause."""


class StorageUnusable(RuntimeError):
    """The checkpoint location cannot be written: the aggregator must not start."""


def slice_key(campaign_id: int, slice_index: int) -> str:
    return f"campaign-{campaign_id}/slice-{slice_index}"


def version_name(version: int) -> str:
    return f"v{version:08d}.pt"


class CheckpointStore(Protocol):
    """Where checkpoints live. Writes are atomic: a reader sees a whole checkpoint or none."""

    def describe(self) -> str: ...

    def check_writable(self) -> None:
        """Raise ``StorageUnusable`` (saying what to fix) unless a checkpoint can be written here."""

    def versions(self, campaign_id: int, slice_index: int) -> list[int]:
        """Versions with a checkpoint of this slice, ascending."""

    def write(self, campaign_id: int, slice_index: int, version: int, data: bytes) -> str: ...

    def read(self, campaign_id: int, slice_index: int, version: int) -> bytes: ...

    def delete(self, campaign_id: int, slice_index: int, version: int) -> None: ...


@dataclass(frozen=True)
class LocalStore:
    """A folder (the embedded default, or a network file system shared by the aggregators)."""

    root: Path

    def describe(self) -> str:
        return str(self.root)

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StorageUnusable(
                f"the checkpoint folder {self.root} is not a writable folder ({exc.strerror or exc}); "
                "pass --checkpoint-dir with a folder this user can write, or a bucket with --checkpoint-url"
            ) from exc

    def _folder(self, campaign_id: int, slice_index: int) -> Path:
        return self.root / slice_key(campaign_id, slice_index)

    def path(self, campaign_id: int, slice_index: int, version: int) -> Path:
        return self._folder(campaign_id, slice_index) / version_name(version)

    def versions(self, campaign_id: int, slice_index: int) -> list[int]:
        folder = self._folder(campaign_id, slice_index)
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for e in folder.iterdir() if (m := _NAME.match(e.name)))

    def write(self, campaign_id: int, slice_index: int, version: int, data: bytes) -> str:
        path = self.path(campaign_id, slice_index, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written next to its final name and moved into place: a crash mid-write never leaves a
        # truncated v*.pt, and a failed write leaves nothing behind to fill the disk.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return str(path)

    def read(self, campaign_id: int, slice_index: int, version: int) -> bytes:
        return self.path(campaign_id, slice_index, version).read_bytes()

    def delete(self, campaign_id: int, slice_index: int, version: int) -> None:
        self.path(campaign_id, slice_index, version).unlink(missing_ok=True)

    def remove_stale_temporaries(self) -> list[Path]:
        """Temporary files a killed process left (a crash between write and rename); they only fill the disk."""
        removed = []
        if self.root.is_dir():
            for tmp in self.root.glob("campaign-*/slice-*/.v*.pt.*.tmp"):
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
        return removed


class S3Store:
    """An S3-compatible bucket (AWS, MinIO, Ceph, moto...), through boto3.

    It reads the site's bucket settings (``CROWDTRAIN_S3_BUCKET``,
    ``CROWDTRAIN_S3_ENDPOINT_URL``, ``CROWDTRAIN_S3_ACCESS_KEY_ID``,
    ``CROWDTRAIN_S3_SECRET_ACCESS_KEY``, ``CROWDTRAIN_S3_REGION``), so one
    bucket holds the site's files and the checkpoints, under ``prefix``. A
    ``put_object`` is atomic, so no temporary objects exist.
    """

    def __init__(self, bucket: str, prefix: str, client: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client

    @classmethod
    def from_url(cls, url: str, environ: Mapping[str, str]) -> S3Store:
        """``s3://bucket/prefix``; credentials and endpoint from the site's ``CROWDTRAIN_S3_*`` variables."""
        import boto3
        from botocore.config import Config

        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        client = boto3.client(
            "s3",
            # Three tries, then the aggregator's own retries (``AggregatorNode.retry_checkpoints``): boto's
            # legacy five take seconds to give up on a store that refuses connections, and a checkpoint
            # tried again every few seconds must not hold a thread that long.
            config=Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5),
            endpoint_url=environ.get("CROWDTRAIN_S3_ENDPOINT_URL") or None,
            aws_access_key_id=environ.get("CROWDTRAIN_S3_ACCESS_KEY_ID") or None,
            aws_secret_access_key=environ.get("CROWDTRAIN_S3_SECRET_ACCESS_KEY") or None,
            region_name=environ.get("CROWDTRAIN_S3_REGION") or None,
        )
        return cls(bucket, prefix or "checkpoints", client)

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, campaign_id: int, slice_index: int, version: int | None = None) -> str:
        base = f"{self.prefix}/{slice_key(campaign_id, slice_index)}/"
        return base if version is None else base + version_name(version)

    def check_writable(self) -> None:
        probe = f"{self.prefix}/.probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as exc:  # botocore's errors: no such bucket, denied, unreachable endpoint
            raise StorageUnusable(
                f"cannot write checkpoints to {self.describe()} ({exc}); check the bucket name, "
                "CROWDTRAIN_S3_ENDPOINT_URL and the credentials (CROWDTRAIN_S3_ACCESS_KEY_ID / _SECRET_ACCESS_KEY)"
            ) from exc

    def versions(self, campaign_id: int, slice_index: int) -> list[int]:
        found = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(campaign_id, slice_index)
        )
        for page in pages:
            for item in page.get("Contents", []):
                match = _NAME.match(item["Key"].rpartition("/")[2])
                if match:
                    found.append(int(match.group(1)))
        return sorted(found)

    def write(self, campaign_id: int, slice_index: int, version: int, data: bytes) -> str:
        key = self._key(campaign_id, slice_index, version)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}"

    def read(self, campaign_id: int, slice_index: int, version: int) -> bytes:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(campaign_id, slice_index, version))["Body"]
        return bytes(body.read())

    def delete(self, campaign_id: int, slice_index: int, version: int) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(campaign_id, slice_index, version))


def encode_state(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class WithFallback:
    """The store, backed by a local folder for the checkpoints it refused (``write_fallback``).

    Reads try the store first, then the folder; listing and deleting cover both, so
    pruning and a rollback's end of a timeline reach the fallback copies too. Only
    the store's copies are confirmed to the site: the folder does not outlive the
    machine, but it lets this process resume where it was after a restart while the
    store is away.
    """

    store: CheckpointStore
    fallback: LocalStore

    def describe(self) -> str:
        return f"{self.store.describe()} (fallback {self.fallback.describe()})"

    def check_writable(self) -> None:
        self.store.check_writable()

    def versions(self, campaign_id: int, slice_index: int) -> list[int]:
        try:
            ours = self.fallback.versions(campaign_id, slice_index)
        except OSError:
            ours = []
        return sorted(set(self.store.versions(campaign_id, slice_index)) | set(ours))

    def write(self, campaign_id: int, slice_index: int, version: int, data: bytes) -> str:
        """Write to the store; when it refuses, keep ``data`` in the folder and raise the store's error all the
        same (the checkpoint is not confirmed). The folder keeps its newest ``KEEP_RECENT`` versions."""
        try:
            where = self.store.write(campaign_id, slice_index, version, data)
        except Exception:
            try:
                kept = self.fallback.write(campaign_id, slice_index, version, data)
                versions = self.fallback.versions(campaign_id, slice_index)
                delete_versions(self.fallback, campaign_id, slice_index, versions[:-KEEP_RECENT])
            except Exception as local:
                logger.error("the fallback checkpoint of version %s failed too: %s", version, local)
            else:
                logger.warning(
                    "checkpoint of campaign %s slice %s version %s kept in %s until the store takes it",
                    campaign_id,
                    slice_index,
                    version,
                    kept,
                )
            raise
        self.fallback.delete(campaign_id, slice_index, version)  # the store holds it now
        return where

    def stored(self, campaign_id: int, slice_index: int, version: int) -> bool:
        """Whether the store itself (not the folder) holds ``version``; False while it does not answer."""
        try:
            return version in self.store.versions(campaign_id, slice_index)
        except Exception:
            return False

    def read(self, campaign_id: int, slice_index: int, version: int) -> bytes:
        try:
            return self.store.read(campaign_id, slice_index, version)
        except Exception as exc:
            try:
                return self.fallback.read(campaign_id, slice_index, version)
            except OSError:
                raise exc from None

    def delete(self, campaign_id: int, slice_index: int, version: int) -> None:
        self.fallback.delete(campaign_id, slice_index, version)
        self.store.delete(campaign_id, slice_index, version)


def save_checkpoint(
    store: CheckpointStore, campaign_id: int, slice_index: int, version: int, state: dict[str, Any]
) -> str:
    """Write one checkpoint; any failure (a full disk shows up as torch's RuntimeError too) is a CheckpointError.

    Returns:
        Where it was written.
    """
    try:
        where = store.write(campaign_id, slice_index, version, encode_state(state))
    except Exception as exc:
        raise CheckpointError(f"checkpoint of version {version} failed: {type(exc).__name__}: {exc}") from exc
    logger.info("checkpoint of campaign %s slice %s version %s written to %s", campaign_id, slice_index, version, where)
    return where


def load_checkpoint(store: CheckpointStore, campaign_id: int, slice_index: int, version: int) -> dict[str, Any]:
    """Read one checkpoint with ``weights_only=True`` (no pickled code runs).

    Raises:
        CheckpointError: if it is missing, unreadable or not a slice checkpoint of ``version``.
    """
    where = f"{store.describe()}/{slice_key(campaign_id, slice_index)}/{version_name(version)}"
    try:
        data = store.read(campaign_id, slice_index, version)
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a missing object, a truncated file, torch's zoo of types for corrupt data
        raise CheckpointError(f"cannot read checkpoint {where}: {exc}") from exc
    if not isinstance(state, dict) or not _STATE_KEYS <= set(state):
        raise CheckpointError(f"{where} is not a Crowdtrain slice checkpoint")
    if state["version"] != version:
        raise CheckpointError(f"{where} holds version {state['version']}, not {version}")
    return state


def to_prune(versions: Iterable[int], current: int, complete: Iterable[int]) -> list[int]:
    """Which checkpoints of one slice to delete, at version ``current``, given the complete versions it knows.

    Kept: the newest ``KEEP_RECENT`` at or below ``current`` and the newest
    ``KEEP_COMPLETE`` complete ones. Versions above ``current`` belong to a
    timeline a rollback ended, and go: kept, they would count as "newest" and
    push every new checkpoint out.
    """
    on_timeline = sorted(v for v in versions if v <= current)
    keep = set(on_timeline[-KEEP_RECENT:]) | set(sorted(v for v in set(complete) if v <= current)[-KEEP_COMPLETE:])
    return [v for v in sorted(versions) if v not in keep]


def delete_versions(store: CheckpointStore, campaign_id: int, slice_index: int, versions: Iterable[int]) -> list[int]:
    """Delete what it can; a failure to delete is logged, never fatal (it only costs space)."""
    deleted = []
    for v in versions:
        try:
            store.delete(campaign_id, slice_index, v)
            deleted.append(v)
        except Exception as exc:
            logger.warning(
                "could not delete checkpoint v%s of campaign %s slice %s: %s", v, campaign_id, slice_index, exc
            )
    return deleted

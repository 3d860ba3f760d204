"""What parameter downloads derive from a slice's snapshots: their checksums and delta bodies, computed once each.

Terms: a *checksum* is the sha256 hex of a snapshot's exact fp32 bytes, sent
with every download so agents can verify what they rebuilt. A *delta* is the
body that turns a held version into a wanted one (``crowdtrain_agent.deltas``).

Both are pure functions of immutable snapshots, so each is computed once, in a
worker thread (megabytes of hashing or compression would stall every socket of
the event loop), and shared by every download asking for it, including the ones
that arrive while it is being computed.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from typing import IO, TYPE_CHECKING, TypeVar

from crowdtrain_agent.deltas import encode_delta, write_delta

from .spool import Body, Spool, release_pages

if TYPE_CHECKING:
    from .slices import Snapshot
T = TypeVar("T")

# Bytes hashed between two releases of a spooled snapshot's pages.
PIECE_BYTES = 16 << 20
# Deltas kept per slice. Most agents hold the version just before the newest, so a few
# (version, from) pairs serve nearly every download; each costs up to a snapshot's size.
DELTAS_KEPT = 3


class DownloadCache:
    """One slice's checksums (by publication) and delta bodies (by pair of publications).

    Entries are keyed by ETag, which is unique to one publication: a version
    republished after a rollback is a new key, never a stale hit. Every method
    runs on the event loop.

    Args:
        deltas_kept: how many delta bodies to keep, least recently used dropped first.
    """

    def __init__(self, deltas_kept: int = DELTAS_KEPT, spool: Spool | None = None) -> None:
        self.deltas_kept = deltas_kept
        self.spool = spool  # where delta bodies wait; None: in memory
        self._checksums: dict[str, asyncio.Future[str]] = {}
        self._deltas: OrderedDict[tuple[str, str], asyncio.Future[Body]] = OrderedDict()
        self.deltas_computed = 0  # how many delta bodies were encoded (tests check that caching works)

    async def checksum(self, snapshot: Snapshot) -> str:
        """The sha256 hex of ``snapshot.body``, hashed in a thread the first time it is asked for."""
        return await self._shared(self._checksums, snapshot.etag, _checksum, snapshot)

    async def delta(self, wanted: Snapshot, held: Snapshot) -> Body:
        """The delta body that rebuilds ``wanted`` from ``held``, encoded in a thread the first time.

        Raises:
            ValueError: if the two snapshots differ in size (they are of different slices).
        """
        key = (wanted.etag, held.etag)
        if key not in self._deltas:
            self.deltas_computed += 1
        body = await self._shared(self._deltas, key, _delta, wanted, held, self.spool)
        if key in self._deltas:
            self._deltas.move_to_end(key)
        while len(self._deltas) > self.deltas_kept:
            self._deltas.popitem(last=False)
        return body

    def release_pages(self) -> None:
        """Spooled delta bodies' pages leave the resident set (``SliceState._publish``, once a step)."""
        for future in self._deltas.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                release_pages(future.result())

    def retain_only_(self, etags: Collection[str]) -> None:
        """Forget what was derived from publications no longer kept (``SliceState._publish`` calls this)."""
        for etag in [e for e in self._checksums if e not in etags]:
            del self._checksums[etag]
        for pair in [p for p in self._deltas if p[0] not in etags or p[1] not in etags]:
            del self._deltas[pair]

    async def _shared(self, cache: dict[K, asyncio.Future[T]], key: K, compute: Callable[..., T], *args: object) -> T:
        """``compute(*args)`` in a thread once per key; concurrent and later callers await the same result."""
        future = cache.get(key)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(compute, *args))
            cache[key] = future
            future.add_done_callback(lambda done: _forget_failure(cache, key, done))
        # Shielded: a download whose client went away must not cancel the work others wait for.
        return await asyncio.shield(future)


K = TypeVar("K", bound=Hashable)


def _forget_failure(cache: dict[K, asyncio.Future[T]], key: K, done: asyncio.Future[T]) -> None:
    """A computation that raised is dropped, so the next download tries again instead of failing forever."""
    if done.cancelled() or done.exception() is not None:
        if cache.get(key) is done:
            del cache[key]


def _checksum(snapshot: Snapshot) -> str:
    """Hashed piece by piece, each piece's pages let go once read: a spooled snapshot is never resident whole."""
    digest = hashlib.sha256()
    body = memoryview(snapshot.body)
    for start in range(0, len(body), PIECE_BYTES):
        digest.update(body[start : start + PIECE_BYTES])
        release_pages(snapshot.body, start, PIECE_BYTES)
    return digest.hexdigest()


def _delta(wanted: Snapshot, held: Snapshot, spool: Spool | None) -> Body:
    """The delta body, written into ``spool`` as it is made when it takes it; the snapshots' pages it read are let go.

    Neither the shuffled planes nor the body is ever whole in memory then,
    which would be twice the slice's size for a moment after every step.
    """

    def read(start: int, length: int) -> None:
        release_pages(wanted.body, start, length)
        release_pages(held.body, start, length)

    def produce(out: IO[bytes]) -> None:
        write_delta(memoryview(wanted.body), memoryview(held.body), out, read=read)

    if spool is not None and spool.wants(len(wanted.body)):
        spooled = spool.write_with(produce)
        if spooled is not None:
            return spooled
    body = encode_delta(memoryview(wanted.body), memoryview(held.body))
    wanted.release_pages()
    held.release_pages()
    return body

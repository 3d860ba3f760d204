"""Blocking downloads a lease needs (shards, verified and cached on disk; parameter slices); run in a thread."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_before_delay, wait_exponential

from . import pooled_http
from .data import sha256_hex
from .deltas import (
    CHECKSUM_HEADER,
    DELTA_FROM_HEADER,
    ENCODING,
    ENCODING_HEADER,
    DeltaError,
    decode_delta_into,
    max_delta_size,
)
from .netmeter import METER
from .protocol import SliceRoute
from .ratelimit import LimitedResponse, Limits

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
HTTP_TIMEOUT_S = 60.0
# A parameter download larger than this is asked for in parts of this size (HTTP Range): an aggregator
# answers each with a copy of what it sends, so a whole 200 MB slice per downloading agent became one part.
PART_BYTES = 16 << 20


class FetchError(RuntimeError):
    """A download that failed in a way a retry right now will not fix."""


class HttpStatusError(FetchError):
    """The server answered with a non-2xx status (``code``)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def http_get(url: str, *, token: str | None = None, timeout: float = HTTP_TIMEOUT_S) -> bytes:
    """GET ``url`` and return the body.

    Raises:
        HttpStatusError: for a non-2xx answer (callers look at ``.code``).
        FetchError: if the server cannot be reached.
    """
    with _open(url, token=token, timeout=timeout) as response:
        try:
            body: bytes = response.read()
        except OSError as exc:
            raise FetchError(f"cannot download {url}: {exc}") from None
    METER.received(len(body))
    return body


def _read_exactly_into(response: Any, url: str, out: memoryview) -> None:
    """Fill ``out`` with the body, which must announce and have exactly ``len(out)`` bytes; counted as received."""
    announced = response.headers.get("Content-Length")
    if announced is None or not announced.isdigit() or int(announced) != len(out):
        raise FetchError(f"{url} sends {announced or 'an unknown number of'} bytes, expected {len(out)}")
    filled = 0
    try:
        while filled < len(out):
            count = response.readinto(out[filled:])
            if not count:
                raise FetchError(f"{url}: the connection closed after {filled} of {len(out)} bytes")
            filled += count
            METER.received(count)
    except OSError as exc:
        raise FetchError(f"cannot download {url}: {exc}") from None


_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,18})-([0-9]{1,18})/([0-9]{1,18})")


def _read_parts_into(response: Any, url: str, token: str | None, buffer_for: Callable[[int], memoryview]) -> memoryview:
    """Read a body that may come in parts: ``response`` is the answer to its first part, or the whole of it.

    ``buffer_for(total)`` gives the buffer the whole body goes into (it may
    refuse the size by raising). A 206 names the part and the total; each
    later part is asked for here, and must come from the same publication
    (ETag) as the first: a version republished meanwhile (a rollback) fails
    the download rather than mixing two.

    Raises:
        FetchError: for a part that does not fit, a changed ETag, or a download that fails.
    """
    if response.status != HTTPStatus.PARTIAL_CONTENT:
        announced = response.headers.get("Content-Length")
        out = buffer_for(int(announced) if announced is not None and announced.isdigit() else -1)
        _read_exactly_into(response, url, out)
        return out
    first, last, total = _part_of(response, url)
    if first != 0:
        raise FetchError(f"{url} answered the first part with bytes {first}-{last}")
    out = buffer_for(total)
    _read_exactly_into(response, url, out[: last + 1])
    etag = response.headers.get("ETag")
    while last + 1 < total:
        wanted = (last + 1, min(total, last + 1 + PART_BYTES) - 1)
        with _open(url, token=token, timeout=HTTP_TIMEOUT_S, part=wanted) as more:
            got = _part_of(more, url) if more.status == HTTPStatus.PARTIAL_CONTENT else None
            if got != (*wanted, total) or more.headers.get("ETag") != etag:
                raise FetchError(
                    f"{url}: asked for bytes {wanted[0]}-{wanted[1]} of {total} of publication {etag}, got "
                    f"{got or 'the whole body'} of {more.headers.get('ETag')}; the version changed while it "
                    "downloaded, and will be downloaded again"
                )
            _read_exactly_into(more, url, out[wanted[0] : wanted[1] + 1])
        last = wanted[1]
    return out


def _exactly(out: memoryview, url: str, total: int) -> memoryview:
    """``out``, for a body of exactly its size."""
    if total != len(out):
        raise FetchError(f"{url} sends {total if total >= 0 else 'an unknown number of'} bytes, expected {len(out)}")
    return out


def _bounded(limit: int, url: str, total: int) -> memoryview:
    """A new buffer for a delta of ``total`` bytes, refused before reading anything past ``limit``."""
    if not 0 <= total <= limit:
        size = total if total >= 0 else "unknown"
        raise DeltaError(f"{url} announces a delta of {size} bytes; at most {limit} are expected")
    return memoryview(bytearray(total))


def _part_of(response: Any, url: str) -> tuple[int, int, int]:
    """``(first, last, total)`` of a 206's Content-Range."""
    match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range") or "")
    if match is None or not int(match[1]) <= int(match[2]) < int(match[3]):
        raise FetchError(f"{url} answered a part with Content-Range {response.headers.get('Content-Range')!r}")
    return int(match[1]), int(match[2]), int(match[3])


def _open(
    url: str, *, token: str | None = None, timeout: float, etag: str = "", part: tuple[int, int] | None = None
) -> Any:
    """``part``: ``(first, last)`` byte of the body wanted (a Range request); a server may answer it whole."""
    headers = {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if etag:
        headers["If-None-Match"] = etag
    if part is not None:
        headers["Range"] = f"bytes={part[0]}-{part[1]}"
    try:
        response = pooled_http.get(url, headers, timeout)
    except OSError as exc:
        raise FetchError(f"cannot download {url}: {exc}") from None
    if not 200 <= response.status < 300:
        response.close()
        raise HttpStatusError(f"HTTP {response.status} from {url}", response.status)
    # The volunteer's download limit, if they set one (``--download-kbps``): every body is read through it.
    return response if Limits.download is None else LimitedResponse(response, Limits.download)


class ShardCache:
    """Content-addressed shard store: memory for the few most recent, disk for the rest.

    Shards are immutable and named by their sha256, so a verified file never
    goes stale; a file whose bytes no longer match its name (a crash mid-write,
    disk trouble, tampering) is deleted and downloaded again.

    Args:
        cache_dir: the agent's cache folder; shards go under ``shards/``.
        shard_url: URL prefix; ``/<sha256>`` is appended.
        token: the device token for the site's shard endpoint.
        memory_items: how many verified shards to keep in memory.
    """

    def __init__(self, cache_dir: Path, shard_url: str, token: str, *, memory_items: int = 8) -> None:
        self.root = Path(cache_dir) / "shards"
        self._url = shard_url
        self._token = token
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_items = memory_items
        self._lock = threading.Lock()  # guards the two dicts: a prefetch thread shares the cache
        self._shard_locks: dict[str, threading.Lock] = {}  # one download per shard at a time
        self.downloads = 0

    def path_for(self, sha256: str) -> Path:
        """Where the verified copy of shard ``sha256`` lives on disk."""
        return self.root / sha256[:2] / sha256

    def get(self, sha256: str) -> bytes:
        """The verified bytes of shard ``sha256``, from memory, disk or the site.

        Raises:
            FetchError: for a malformed name, a download that fails, or bytes
                that do not match the name.
        """
        if not _SHA256.fullmatch(sha256):
            raise FetchError(f"shard name {sha256!r} is not a lower-case sha256 hex digest")
        with self._lock:
            shard_lock = self._shard_locks.setdefault(sha256, threading.Lock())
        with shard_lock:  # a lease needing the shard a prefetch is downloading waits for that download
            with self._lock:
                data = self._memory.get(sha256)
                if data is not None:
                    self._memory.move_to_end(sha256)
                    return data
            data = self._read_disk(sha256)
            if data is None:
                data = self._download(sha256)
                self._write_disk(sha256, data)
            with self._lock:
                self._memory[sha256] = data
                while len(self._memory) > self._memory_items:
                    self._memory.popitem(last=False)
            return data

    def in_memory(self, sha256: str) -> bool:
        """Whether ``get`` would answer without touching the disk or the network."""
        with self._lock:
            return sha256 in self._memory

    def _read_disk(self, sha256: str) -> bytes | None:
        path = self.path_for(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if sha256_hex(data) == sha256:
            return data
        logger.warning("cached shard %s is corrupted (%d bytes); deleting it and downloading again", path, len(data))
        path.unlink(missing_ok=True)
        return None

    def _download(self, sha256: str) -> bytes:
        url = f"{self._url.rstrip('/')}/{sha256}"
        started = time.perf_counter()
        try:
            data = http_get(url, token=self._token)
        except HttpStatusError as exc:
            raise FetchError(f"shard {sha256[:12]}: the site answered HTTP {exc.code} for {url}") from None
        actual = sha256_hex(data)
        if actual != sha256:
            raise FetchError(
                f"shard {sha256[:12]}: downloaded {len(data)} bytes whose sha256 is {actual[:12]}; "
                "the download was damaged or the server is misconfigured, the lease will be retried"
            )
        self.downloads += 1
        logger.debug("shard %s: %d bytes in %.1f ms", sha256[:12], len(data), 1e3 * (time.perf_counter() - started))
        return data

    def _write_disk(self, sha256: str, data: bytes) -> None:
        path = self.path_for(sha256)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so a crash never leaves a truncated file under the final name.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning(
                "cannot cache shard %s in %s (%s); it will be downloaded again next time", sha256[:12], path.parent, exc
            )


class _DeltaUnusable(FetchError):
    """A delta download that cannot be trusted; the slice is then downloaded in full.

    A FetchError, so that a delta nobody asked for (on the full download) fails the lease like any bad body.
    """


@dataclass(frozen=True)
class HeldVersion:
    """The exact fp32 parameters of one version as downloaded: the base of a later version's delta."""

    version: int
    flat: torch.Tensor  # owned by the store, never loaded into a model
    etags: tuple[str, ...] = ()  # of each slice's publication, in route order (``still_current``)


class HeldParams:
    """The last parameter version each campaign's downloads produced, kept exactly as the aggregators sent it.

    A copy of its own, not the model: a model loaded on the CPU uses the
    downloaded vector's memory for its parameters, and a compute thread may
    change them (local steps) while the next lease's download runs. A delta
    applied to anything but the published bytes would fail its checksum.

    It costs one fp32 copy of the model per campaign kept; ``campaigns`` bounds
    that (least recently downloaded dropped first). Thread-safe.

    Args:
        campaigns: how many campaigns to keep a version of.
    """

    def __init__(self, campaigns: int = 2) -> None:
        self.campaigns = campaigns
        self._held: OrderedDict[int, HeldVersion] = OrderedDict()
        self._lock = threading.Lock()
        self._downloading: dict[tuple[int, int], threading.Lock] = {}

    def downloading(self, campaign_id: int, version: int) -> threading.Lock:
        """The lock one download of a campaign's version holds: a second download of it waits, then reuses it.

        An overlapped lease downloads its round's base while the next lease,
        issued once that version exists, downloads the same one.
        """
        with self._lock:
            lock = self._downloading.get((campaign_id, version))
            if lock is None:
                for key in [k for k in self._downloading if k[0] == campaign_id and k[1] < version - 4]:
                    del self._downloading[key]
                lock = self._downloading[(campaign_id, version)] = threading.Lock()
            return lock

    def exactly(self, campaign_id: int, param_count: int, version: int) -> HeldVersion | None:
        """The held version of this campaign if it is ``version`` itself (its ETags tell if it is still current)."""
        with self._lock:
            held = self._held.get(campaign_id)
        if held is None or held.flat.numel() != param_count or held.version != version:
            return None
        return held

    def base_for(self, campaign_id: int, param_count: int, version: int) -> HeldVersion | None:
        """A held version of this campaign that ``version`` can be sent as a delta of, if any.

        Only an older version of the same size: the slice layout may change
        between leases (each slice's base is cut from the whole vector), the
        parameter count may not.
        """
        with self._lock:
            held = self._held.get(campaign_id)
        if held is None or held.flat.numel() != param_count or held.version >= version:
            return None
        return held

    def keep_(
        self, campaign_id: int, version: int, flat: torch.Tensor, etags: Sequence[str] = (), *, shared: bool = False
    ) -> None:
        """Remember ``flat``, verified parameters of ``version``, as this campaign's base.

        A copy, unless ``shared``: the caller promises nothing will write into
        ``flat`` (a model in sync mode only reads its parameters), and the
        store then holds the very tensor, one model's size less.
        """
        kept = flat.detach() if shared else flat.detach().to("cpu", torch.float32, copy=True)
        with self._lock:
            self._held[campaign_id] = HeldVersion(version, kept, tuple(etags))
            self._held.move_to_end(campaign_id)
            while len(self._held) > self.campaigns:
                self._held.popitem(last=False)


def fetch_slice(
    route: SliceRoute,
    version: int,
    out: torch.Tensor | None = None,
    *,
    ticket: str | None = None,
    retry_for_s: float = 10.0,
    etags: list[str] | None = None,
    held: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Download elements ``route.start:route.end`` of parameter version ``version`` (into ``out`` if given).

    ``ticket`` is a lease's ticket (or one the site signed): aggregators give a
    campaign's parameters only to its holders, so invite-only weights stay private.

    A 404 usually means the version is being published right now (the lease
    was handed out as the last slice stepped), so it is retried for a while.

    With ``held``, ``(held_version, its elements of this slice)``, the slice is
    asked for as a delta from that version (``crowdtrain_agent.deltas``); an
    aggregator that does not keep it, or predates deltas, answers fp32. The
    result is checked against the aggregator's sha256 of the exact fp32 bytes
    whenever it sends one (it always does with a delta); a delta that fails
    the check is replaced by a full download, never used.

    Raises:
        FetchError: if the slice stays missing, has the wrong size, fails its
            checksum, or cannot be downloaded.
    """
    numel = route.end - route.start
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    array = out.numpy()
    target = array.data.cast("B")
    url = f"{route.params_url}{version}"
    etag: str | None = None
    if held is not None:
        held_version, held_flat = held
        # The wire's bytes (little-endian); a view, no copy, on little-endian machines.
        base = held_flat.detach().contiguous().numpy().astype("<f4", copy=False).data.cast("B")
        try:
            etag = _retrying(route, version, url, lambda: _get_params(url, target, ticket, (held_version, base)),
                             retry_for_s)  # fmt: skip
        except _DeltaUnusable as exc:
            logger.warning(
                "parameters of version %d, slice %d: the delta from version %d is unusable (%s); "
                "downloading the full version instead",
                version,
                route.index,
                held_version,
                exc,
            )
    if etag is None:
        etag = _retrying(route, version, url, lambda: _get_params(url, target, ticket, None), retry_for_s)
    if etags is not None:
        etags.append(etag)
    if sys.byteorder == "big":  # the wire is little-endian
        array.byteswap(inplace=True)
    return out


def _retrying(route: SliceRoute, version: int, url: str, attempt: Callable[[], str], retry_for_s: float) -> str:
    """``attempt()`` again while it meets a 404 (a version being published) for up to ``retry_for_s``."""

    def note_unpublished(state: RetryCallState) -> None:
        logger.debug(
            "slice %d of version %d not published yet; retrying in %.2f s", route.index, version, state.upcoming_sleep
        )

    retrying = Retrying(
        retry=retry_if_exception(_not_published),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=stop_before_delay(retry_for_s),
        before_sleep=note_unpublished,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except HttpStatusError as exc:
        raise FetchError(f"parameters of version {version}, slice {route.index}: HTTP {exc.code} from {url}") from None
    except _DeltaUnusable:
        raise  # fetch_slice falls back to a full download
    except FetchError as exc:
        raise FetchError(
            f"parameters of version {version}, slice {route.index} (fp32 elements {route.start}:{route.end}): {exc}"
        ) from None


def _not_published(exc: BaseException) -> bool:
    """A 404 from an aggregator: the version is being published there, and will be soon."""
    return isinstance(exc, HttpStatusError) and exc.code == 404


def _get_params(url: str, out: memoryview, ticket: str | None, held: tuple[int, memoryview] | None) -> str:
    """One GET of a slice's parameters into ``out`` (little-endian fp32 bytes), verified; returns the ETag.

    Raises:
        HttpStatusError: for a non-2xx answer.
        FetchError: for a full body of the wrong size or whose checksum does not match.
        _DeltaUnusable: for a delta that cannot be decoded, or whose result cannot be verified.
    """
    # The ticket, never the device token: the device token is for the site alone.
    asked = url if held is None else f"{url}?from={held[0]}"
    part = (0, PART_BYTES - 1) if len(out) > PART_BYTES else None
    with _open(asked, token=ticket, timeout=HTTP_TIMEOUT_S, part=part) as response:
        headers = response.headers
        delta_from = headers.get(DELTA_FROM_HEADER)
        if delta_from is None:  # fp32, from an aggregator without the held version or older than deltas
            _read_parts_into(response, asked, ticket, functools.partial(_exactly, out, url))
        else:
            encoding = headers.get(ENCODING_HEADER)
            if held is None or delta_from != str(held[0]) or encoding != ENCODING:
                raise _DeltaUnusable(
                    f"the aggregator sent a delta from version {delta_from!r} encoded as {encoding!r}, "
                    f"where {ENCODING!r} from {held[0] if held else 'no version'} was asked for"
                )
            try:
                buffer_for = functools.partial(_bounded, max_delta_size(len(out)), url)
                body = _read_parts_into(response, asked, ticket, buffer_for)
                decode_delta_into(body, held[1], out)
            except DeltaError as exc:
                raise _DeltaUnusable(str(exc)) from None
            logger.debug("%s: a delta of %d bytes instead of %d", url, len(body), len(out))
        expected = headers.get(CHECKSUM_HEADER)
        if expected is None:
            if delta_from is not None:
                raise _DeltaUnusable("it came without a checksum to verify the rebuilt parameters against")
        else:
            actual = hashlib.sha256(out).hexdigest()
            if actual != expected:
                if delta_from is not None:
                    raise _DeltaUnusable(
                        f"the rebuilt parameters' sha256 is {actual[:12]}, the aggregator's {expected[:12]}"
                    )
                raise FetchError(
                    f"{url}: the downloaded parameters' sha256 is {actual[:12]}, the aggregator's {expected[:12]}; "
                    "the download was damaged on the way, the lease will be retried"
                )
        return str(headers.get("ETag") or "")


def fetch_params(
    routes: list[SliceRoute],
    version: int,
    param_count: int,
    *,
    ticket: str | None = None,
    etags: list[str] | None = None,
    held: HeldParams | None = None,
    campaign_id: int | None = None,
    wait_s: float = 10.0,
    read_only: bool = False,
) -> torch.Tensor:
    """Assemble the flat fp32 parameter vector of ``version`` from every aggregator's slice.

    Args:
        etags: if given, each slice's ETag is appended, in route order (for ``still_current``).
        held: the agent's store of downloaded versions; with ``campaign_id``, an
            older version held for the campaign makes each slice a delta
            download, and the verified result becomes the campaign's new base.
            The version itself, held and still current, is copied instead of
            downloaded, and two downloads of one version take turns.
        campaign_id: the campaign whose parameters these are (the key into ``held``).
        wait_s: how long to keep asking for a version that is not published yet.
        read_only: the caller never writes into the result (a model in sync mode), so ``held`` keeps the
            result itself as the next base instead of a copy of it.

    Raises:
        FetchError: if the slices do not tile 0..param_count exactly, or a download fails.
    """
    check_routes(routes, param_count)
    if held is None or campaign_id is None:
        return _download_params(routes, version, param_count, ticket, etags, None, wait_s)
    with held.downloading(campaign_id, version):
        same = held.exactly(campaign_id, param_count, version)
        if same is not None and still_current(routes, version, same.etags, ticket=ticket):
            if etags is not None:
                etags.extend(same.etags)
            return same.flat.clone()
        got: list[str] = []
        base = held.base_for(campaign_id, param_count, version)
        flat = _download_params(routes, version, param_count, ticket, got, base, wait_s)
        held.keep_(campaign_id, version, flat, got, shared=read_only)
    if etags is not None:
        etags.extend(got)
    return flat


def _download_params(
    routes: list[SliceRoute],
    version: int,
    param_count: int,
    ticket: str | None,
    etags: list[str] | None,
    base: HeldVersion | None,
    wait_s: float,
) -> torch.Tensor:
    flat = torch.empty(param_count, dtype=torch.float32)
    for route in routes:
        slice_base = None if base is None else (base.version, base.flat[route.start : route.end])
        fetch_slice(
            route, version, flat[route.start : route.end], ticket=ticket, etags=etags, held=slice_base,
            retry_for_s=wait_s,
        )  # fmt: skip
    return flat


def still_current(routes: list[SliceRoute], version: int, etags: Sequence[str], *, ticket: str | None = None) -> bool:
    """Whether parameters of ``version`` held with these ETags are still the aggregators' (all answer 304).

    A version number alone does not name parameters: after a rollback the
    campaign makes version 9 again, from other gradients, and an agent that
    kept the old version 9 would train on weights that no longer exist. Each
    publication has its own ETag, so a conditional GET per slice tells (a few
    hundred bytes when nothing changed). Any other answer means: download again.
    """
    if len(etags) != len(routes) or not all(etags):
        return False
    for route, etag in zip(routes, etags, strict=True):
        try:
            with _open(f"{route.params_url}{version}", token=ticket, timeout=HTTP_TIMEOUT_S, etag=etag):
                return False  # 200: a new publication of this version
        except HttpStatusError as exc:
            if exc.code != 304:
                return False
        except FetchError:
            return False
    return True


def check_routes(routes: list[SliceRoute], param_count: int) -> None:
    """Raise FetchError unless the slices cover 0..param_count once each, without gaps."""
    position = 0
    for route in sorted(routes, key=lambda r: r.start):
        if route.start != position or route.end <= route.start:
            raise FetchError(
                f"lease slices do not tile the {param_count} parameters: slice {route.index} is "
                f"{route.start}:{route.end} where {position} was expected; the site sent an inconsistent lease"
            )
        position = route.end
    if position != param_count:
        raise FetchError(f"lease slices end at element {position} but the model has {param_count} parameters")

"""Plain HTTP on the aggregator's port: parameter slices by version, a health check and Prometheus metrics."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from crowdtrain_agent import deltas
from crowdtrain_agent.protocol import ProtocolError, ticket_campaign, verify_ticket
from crowdtrain_agent.scrape_access import scrape_refusal

from .config import ENV_PREFIX
from .node import AggregatorNode
from .spool import Body, release_pages

logger = logging.getLogger(__name__)

UPLOAD_PATH = "/upload"
PARAMS_PREFIX = "/params/"
# GET /params/<campaign_id>/<slice_index>/<version>; the site builds agents' URLs
# as f"{params_url}{campaign_id}/{slice_index}/" + version, so keep this layout.
_PARAMS = re.compile(r"^/params/(\d{1,18})/(\d{1,9})/(\d{1,18})/?$")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes other scripts' digits
_RANGE = re.compile(r"bytes=([0-9]{0,18})-([0-9]{0,18})")  # one range; a list of them is served whole
# A version never changes once published, so the fetcher may keep it forever; but only the
# fetcher: an invite-only campaign's weights are not for shared caches.
IMMUTABLE = "private, max-age=31536000, immutable"
# How long a download of a version still being applied waits for it; well under the agent's HTTP timeout.
PARAMS_WAIT_S = 5.0

# A browser tab (docs/browser-compute.md) downloads parameters from a page of the site's origin, not this one:
# the answers under /params/ carry CORS headers, errors included, so the tab can read why. Any origin:
# what authorizes a download is a ticket in Authorization, never a cookie, so no page gains anything by it.
EXPOSED_HEADERS = ("ETag", "Content-Range", "X-Crowdtrain-Version", deltas.CHECKSUM_HEADER,
                   deltas.DELTA_FROM_HEADER, deltas.ENCODING_HEADER)  # fmt: skip
CORS_HEADERS = [
    ("Access-Control-Allow-Origin", "*"),
    ("Access-Control-Expose-Headers", ", ".join(EXPOSED_HEADERS)),
    # A page isolated for wasm threads (COEP require-corp) loads only what says it may be embedded.
    ("Cross-Origin-Resource-Policy", "cross-origin"),
]
# What a preflight (OPTIONS) is told: a GET with the ticket, a held ETag and a byte range may follow.
PREFLIGHT_HEADERS = [
    ("Access-Control-Allow-Methods", "GET"),
    ("Access-Control-Allow-Headers", "Authorization, If-None-Match, Range"),
    ("Access-Control-Max-Age", "7200"),  # Chromium's cap: one preflight per two hours per URL
]

# A header line longer than this is answered 431 (RFC 6585), as the port answered before it ran on aiohttp;
# aiohttp reads header fields up to READ_HEADER_BYTES, so that the rule, not its parser, refuses them.
MAX_HEADER_LINE_BYTES = 8192
READ_HEADER_BYTES = 64 << 10

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _response(
    status: HTTPStatus, body: bytes, content_type: str, extra: list[tuple[str, str]] | None = None
) -> web.Response:
    """A small answer held whole; aiohttp adds Date and Content-Length, and keeps the connection open."""
    headers = [("Content-Type", content_type), *(extra or [])]
    return web.Response(status=status.value, body=body, headers=headers)


def json_response(
    status: HTTPStatus, payload: dict[str, Any], extra: list[tuple[str, str]] | None = None
) -> web.Response:
    """A small JSON answer; errors are ``{"error": "..."}`` (short, lower-case, one fact)."""
    return _response(status, json.dumps(payload).encode(), "application/json", extra)


async def params_response(
    node: AggregatorNode, request: web.Request, campaign_id: int, slice_index: int, version: int
) -> web.StreamResponse:
    """The fp32 bytes of one slice at one version, or a delta from a version the caller holds, or why not.

    A version the slice is about to publish (a commit in flight) is waited
    for, up to ``PARAMS_WAIT_S``. With ``?from=<held>`` naming a kept version
    below ``version``, the body is a delta (``crowdtrain_agent.deltas``) and
    ``X-Crowdtrain-Delta-From`` says so; otherwise it is the full fp32 bytes.
    Either way ``X-Crowdtrain-Sha256`` carries the checksum of the exact fp32 bytes.

    400: ``from`` is not a version number.
    404: the slice is not held here, or the version is not published yet.
    410: the version was published but is no longer kept (out of the window, or rolled back past).
    """
    refused = _check_ticket(node, request, campaign_id)
    if refused is not None:
        return refused
    held_version, refused = _held_version(request)
    if refused is not None:
        return refused
    state = node.get_slice(campaign_id, slice_index)
    if state is None:
        return json_response(HTTPStatus.NOT_FOUND, {"error": "slice not held"})
    snapshot = await state.wait_for_snapshot(version, PARAMS_WAIT_S)
    if snapshot is None:
        if version > state.version:
            return json_response(HTTPStatus.NOT_FOUND, {"error": "version not published yet"})
        return json_response(HTTPStatus.GONE, {"error": "version dropped"})
    extra = [("ETag", snapshot.etag), ("Cache-Control", IMMUTABLE), ("X-Crowdtrain-Version", str(version))]
    if request.headers.get("If-None-Match") == snapshot.etag:
        return _response(HTTPStatus.NOT_MODIFIED, b"", "application/octet-stream", extra)
    # Held references: a step published meanwhile may drop either snapshot from the slice, not from here.
    held = state.snapshots.get(held_version) if held_version is not None and held_version < version else None
    extra.append((deltas.CHECKSUM_HEADER, await state.downloads.checksum(snapshot)))
    if held is not None:
        body = await state.downloads.delta(snapshot, held)
        if len(body) < len(snapshot.body):  # random-looking parameters do not compress: fp32 is then cheaper
            extra += [(deltas.DELTA_FROM_HEADER, str(held.version)), (deltas.ENCODING_HEADER, deltas.ENCODING)]
            return await _part_or_whole(request, body, extra)
    return await _part_or_whole(request, snapshot.body, extra)


async def _part_or_whole(request: web.Request, body: Body, extra: list[tuple[str, str]]) -> web.StreamResponse:
    """``body``, or the one byte range the request asks for (206; 416 for a range past its end).

    What the socket does not take at once waits in the event loop's buffer:
    a whole slice per download, per agent downloading. Agents ask for a
    large slice in parts (``crowdtrain_agent.fetch.PART_BYTES``), so a
    download holds one part here, whatever the slice's size. Anything but a
    single ``bytes=`` range is ignored, as RFC 9110 allows: the whole body;
    so is an invalid range.
    """
    match = _RANGE.fullmatch(request.headers.get("Range") or "")
    if match is None or not (match[1] or match[2]) or (match[1] and match[2] and int(match[1]) > int(match[2])):
        # Not one range, or an invalid one ("5-3"): RFC 9110 ignores the header.
        return await _send_body(request, HTTPStatus.OK, body, 0, len(body), [*extra, ("Accept-Ranges", "bytes")])
    total = len(body)
    first = int(match[1]) if match[1] else None
    last = int(match[2]) if match[2] else None
    if first is None:  # "bytes=-N": the last N bytes
        if last is None or last == 0:
            return _unsatisfiable(total, extra)
        first, last = max(0, total - last), total - 1
    elif last is None or last >= total:
        last = total - 1
    if first > last or first >= total:
        return _unsatisfiable(total, extra)
    extra = [*extra, ("Content-Range", f"bytes {first}-{last}/{total}")]
    return await _send_body(request, HTTPStatus.PARTIAL_CONTENT, body, first, last + 1 - first, extra)


async def _send_body(
    request: web.Request, status: HTTPStatus, body: Body, start: int, length: int, extra: list[tuple[str, str]]
) -> web.StreamResponse:
    """Send bytes ``start:start+length`` of ``body``, then let a spooled body's pages go.

    A view, not a copy: the transport copies what the socket does not take at
    once, and a copy made here too cost the heap several slices' worth while
    a crowd downloaded. Once written, the pages are read; without letting them
    go they stayed resident to the next step, a slice's worth after every
    step's downloads. Read again, they come from the page cache: never a wrong byte.
    """
    response = web.StreamResponse(status=status.value, headers=[("Content-Type", "application/octet-stream"), *extra])
    response.content_length = length
    await response.prepare(request)
    try:
        with memoryview(body) as whole, whole[start : start + length] as part:
            await response.write(part)
        await response.write_eof()
    finally:
        release_pages(body, start, length)
    return response


def _unsatisfiable(total: int, extra: list[tuple[str, str]]) -> web.Response:
    headers = [*extra, ("Content-Range", f"bytes */{total}")]
    return _response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, b"", "application/octet-stream", headers)


def _held_version(request: web.Request) -> tuple[int | None, web.Response | None]:
    """The ``from`` query parameter: the version the caller holds (None without one), or a 400 to answer."""
    values = request.query.getall("from", None)
    if values is None:
        return None, None
    if len(values) != 1 or not _DIGITS.fullmatch(values[0]):
        error = "from must be the version number you hold, digits only, once"
        return None, json_response(HTTPStatus.BAD_REQUEST, {"error": error})
    if len(values[0]) > 18:  # a version no campaign reaches: not held here, so the full body
        return None, None
    return int(values[0]), None


def metrics_response(node: AggregatorNode, request: web.Request) -> web.Response:
    """The node's metrics in Prometheus's text format, to a scraper the token rule lets in (``metrics``)."""
    token, authorization = node.config.metrics_token, request.headers.get("Authorization")
    refused = scrape_refusal(
        token, authorization, request.headers.keys(), request.remote, setting=f"{ENV_PREFIX}METRICS_TOKEN"
    )
    if refused is not None:
        status, message = refused
        return json_response(HTTPStatus(status), {"error": message})
    return _response(HTTPStatus.OK, node.metrics.render(), CONTENT_TYPE_LATEST)


def _check_ticket(node: AggregatorNode, request: web.Request, campaign_id: int) -> web.Response | None:
    """Parameters go only to holders of a ticket the site signed for this campaign (a lease's, or its own).

    Checked before anything else, so a refused caller learns nothing about which slices exist.
    """
    if node.ticket_key is None:
        return json_response(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "not connected to the site yet; retry soon"})
    scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return json_response(HTTPStatus.UNAUTHORIZED, {"error": "send a lease's ticket as Authorization: Bearer"})
    try:
        named = ticket_campaign(token.strip())  # unverified: a forged campaign id fails the signature below
        if named != campaign_id:
            return json_response(HTTPStatus.FORBIDDEN, {"error": f"the ticket is for campaign {named}"})
        key = node.campaign_key(campaign_id)  # each campaign has its own key, known here with a slice of it
        if key is None:  # what a verified ticket would learn next; routes to a campaign's slices are no secret
            return json_response(HTTPStatus.NOT_FOUND, {"error": "slice not held"})
        verify_ticket(token.strip(), key)
    except ProtocolError as exc:
        return json_response(HTTPStatus.FORBIDDEN, {"error": str(exc)[:200]})
    return None


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Give every answer under ``/params/`` the CORS headers, as it is prepared: bodies, 304s and errors alike.

    An ``on_response_prepare`` hook rather than headers added by each answer,
    so no refusal (401, 404, 410, 416, a 431 for a long header) goes out
    without them: a browser hides an answer without them from the page, which
    then sees only "failed to fetch" and cannot tell a dropped version from a
    network error.
    """
    if request.rel_url.raw_path.startswith(PARAMS_PREFIX):
        for name, value in CORS_HEADERS:
            response.headers[name] = value


def _preflight(path: str) -> web.Response:
    """The answer to a browser's ``OPTIONS`` before a cross-origin GET of parameters (CORS added as prepared)."""
    if not _PARAMS.match(path):
        return json_response(HTTPStatus.NOT_FOUND, {"error": "not found"})
    return _response(HTTPStatus.NO_CONTENT, b"", "text/plain", [*PREFLIGHT_HEADERS, ("Allow", "GET, OPTIONS")])


def make_router(node: AggregatorNode, upload: Answer) -> Answer:
    """The one handler of every path on the aggregator's port: ``/upload`` goes to ``upload``, the rest is HTTP.

    One handler for all paths and methods rather than a route table, so that
    every refusal is the same JSON: 405 for anything but GET (and a browser's
    CORS preflight, OPTIONS, under ``/params/``), 404 for a path this does not
    know. ``add_cors_headers`` must be hooked to the application too.

    Args:
        node: the aggregator state to serve from.
        upload: answers ``/upload`` (the WebSocket handshake and the uploads on it).

    Returns:
        An aiohttp handler.
    """

    async def route(request: web.Request) -> web.StreamResponse:
        too_long = next(
            (name for name, value in request.raw_headers if len(name) + len(value) + 2 > MAX_HEADER_LINE_BYTES), None
        )
        if too_long is not None:
            error = f"header {too_long[:40].decode(errors='replace')} is over {MAX_HEADER_LINE_BYTES} bytes"
            return json_response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, {"error": error})
        if request.method == "OPTIONS" and request.rel_url.raw_path.startswith(PARAMS_PREFIX):
            return _preflight(request.rel_url.raw_path)
        if request.method != "GET":  # the WebSocket handshake is a GET too
            error = f"{request.method[:20]} is not answered here; every path takes GET"
            return json_response(HTTPStatus.METHOD_NOT_ALLOWED, {"error": error}, [("Allow", "GET")])
        path = request.rel_url.raw_path  # undecoded, so /params/1/0/%31 is no version
        if path == UPLOAD_PATH:
            return await upload(request)
        if path == "/healthz":
            return json_response(HTTPStatus.OK, node.health())
        if path == "/metrics":
            return metrics_response(node, request)
        match = _PARAMS.match(path)
        if match:
            campaign_id, slice_index, version = (int(g) for g in match.groups())
            return await params_response(node, request, campaign_id, slice_index, version)
        return json_response(HTTPStatus.NOT_FOUND, {"error": "not found"})

    return route

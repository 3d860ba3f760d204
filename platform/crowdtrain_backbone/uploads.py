"""The data channel: agents stream gradient slices here, one ``upload`` message plus binary chunks each.

Exchange, per upload, on a ``/upload`` WebSocket that may carry many uploads:

1. text ``UploadBegin`` {ticket, slice_index, codec, num_elements, num_chunks, codec_block_size};
2. ``num_chunks`` binary frames made by ``protocol.split_payload`` (every
   chunk ``CHUNK_PAYLOAD_BYTES`` long except the last), in order;
3. one text reply: ``UploadReceipt`` or ``UploadRejected``.

A rejected upload leaves the connection usable: the binary frames still on
their way for it are discarded until the next text message. Only a broken
chunk header, a binary frame with no upload announced, too many rejections
in a row, or no first header within ``header_timeout_s`` of connecting close
the socket (with a ``protocol.CloseCode``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import mmap
from collections.abc import Callable

import msgspec
import numpy as np
import torch
from aiohttp import WSCloseCode, WSMsgType, hdrs, web

from crowdtrain_agent.codec import CODECS, Codec, get_codec
from crowdtrain_agent.protocol import (
    AGENT_TO_AGGREGATOR,
    CHUNK_PAYLOAD_BYTES,
    MAX_WS_MESSAGE_BYTES,
    UPLOAD_REFUSED_SINCE,
    CloseCode,
    ProtocolError,
    SubprotocolError,
    Ticket,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    choose_subprotocol,
    decode_chunk,
    decode_message,
    encode_message,
    negotiated_minor,
    sign_receipt,
    ticket_campaign,
    verify_ticket,
)
from crowdtrain_agent.sketch import SKETCH_COORDINATES, sketch, sketch_seed, to_bytes

from .node import AggregatorNode
from .slices import PendingUpload, UploadRefused
from .spool import Spool, SpoolFile, release_pages

logger = logging.getLogger(__name__)

# Rejections in a row after which a connection is more likely hostile than unlucky.
MAX_REJECTIONS_IN_A_ROW = 100
# Decoding and checking a slice this big would stall the event loop noticeably.
THREAD_DECODE_BYTES = 1 << 20
# A stalled upload holds its share of the pending-memory budget; give it back after this.
CHUNK_TIMEOUT_S = 60.0
# What the upload port holds for a client that stops reading or goes quiet. A send waits once
# WRITE_LIMIT_BYTES of replies are buffered for a client that does not read them, so such a
# client stalls only its own upload session; a keepalive ping goes out every PING_INTERVAL_S,
# and a client that has not answered it within half that (it reads nothing, or its machine is
# gone) is dropped. A socket that never sends its first upload header is closed after
# BackboneConfig.header_timeout_s.
PING_INTERVAL_S = 20.0
WRITE_LIMIT_BYTES = 64 << 10  # receipts and rejections are a few hundred bytes each


class SocketClosed(Exception):
    """The agent's upload socket closed (or failed); the session ends."""


class UploadSocket:
    """An accepted ``/upload`` WebSocket as the session reads it: text or bytes, or SocketClosed."""

    def __init__(self, ws: web.WebSocketResponse, remote_address: str | None) -> None:
        self.ws = ws
        self.remote_address = remote_address
        self.subprotocol = ws.ws_protocol

    async def recv(self) -> str | bytes:
        """The next data message; pings, pongs and the closing handshake are answered underneath.

        Raises:
            SocketClosed: the socket closed, or the agent broke the framing (aiohttp then closes it).
        """
        message = await self.ws.receive()
        if message.type is WSMsgType.TEXT:
            return str(message.data)
        if message.type is WSMsgType.BINARY:
            return bytes(message.data)
        raise SocketClosed(str(message.data))

    async def send(self, text: str) -> None:
        """Send one text message.

        Raises:
            SocketClosed: the socket is closing or gone.
        """
        try:
            await self.ws.send_str(text)
        except ConnectionError as exc:
            raise SocketClosed(str(exc)) from None

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, message=reason.encode())


class Rejected(Exception):
    """An upload refused with ``code``; ``discard`` says whether its remaining chunks are still coming."""

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        lease_id: int | None = None,
        slice_index: int | None = None,
        campaign_id: int | None = None,
        discard: bool = True,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.campaign_id = campaign_id  # known once the ticket verified: then the site may hear of it
        self.lease_id = lease_id
        self.slice_index = slice_index
        self.discard = discard


def _message_error_code(text: str | bytes, exc: ProtocolError) -> str:
    """A short code for a text frame that did not decode, so agents can branch on it."""
    if exc.close_code == CloseCode.TOO_LARGE:
        return "too large"
    try:
        data = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return "malformed json"
    if not isinstance(data, dict):
        return "malformed message"
    if data.get("kind") != UploadBegin.__struct_config__.tag:
        return "unknown message"
    codec = data.get("codec")
    if codec is not None and (not isinstance(codec, str) or codec not in CODECS):
        return "unknown codec"
    return "malformed message"


def check_and_sketch(
    grad: torch.Tensor, ticket: Ticket, max_grad_norm: float, seed: int | None
) -> tuple[torch.Tensor, bytes]:
    """``check_gradient``, and the sketch of ``grad`` under ``seed`` (none without one) for the receipt."""
    check_gradient(grad, ticket, max_grad_norm)
    if seed is None:
        return grad, b""
    return grad, to_bytes(sketch(grad, seed, coordinates=SKETCH_COORDINATES))


def decode_gradient(codec: Codec, data: bytearray, num_elements: int, ticket: Ticket) -> torch.Tensor:
    """One slice's values from its reassembled payload (``data``, this upload's own buffer).

    Raises:
        Rejected: "bad payload" (bytes no encoder writes: an int8 scale that is NaN, infinite or negative).
    """
    try:
        return codec.adopt(data, num_elements)
    except ProtocolError as exc:  # the length was checked on arrival; this is about the bytes themselves
        raise Rejected(
            "bad payload", f"lease {ticket.lease_id}: {exc}", lease_id=ticket.lease_id, campaign_id=ticket.campaign_id
        ) from None


def check_gradient(grad: torch.Tensor, ticket: Ticket, max_grad_norm: float) -> None:
    """Check one slice's values are finite and within the per-sample norm bound.

    Args:
        grad: the decoded slice.
        ticket: the verified ticket (its ``num_samples`` weighs the norm bound).
        max_grad_norm: bound on ||g|| / num_samples; 0 disables it. Checked per
            slice, which is a necessary condition for the whole gradient's bound.

    Raises:
        Rejected: "not finite" or "norm bound".
    """
    values = grad.numpy()  # numpy's checks are several times faster than torch's on one thread
    if not np.isfinite(values).all():
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        raise Rejected(
            "not finite",
            f"lease {ticket.lease_id}: {bad} gradient values are NaN or infinite; "
            "lower the learning rate or use fp32 if fp16 overflows",
            lease_id=ticket.lease_id,
            campaign_id=ticket.campaign_id,
        )
    if max_grad_norm > 0:
        norm = float(torch.linalg.vector_norm(grad))
        if not math.isfinite(norm):  # squares of huge fp32 values overflow; float64 gives the true figure
            norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        per_sample = norm / ticket.num_samples
        if per_sample > max_grad_norm:
            raise Rejected(
                "norm bound",
                f"lease {ticket.lease_id}: gradient norm per sample {per_sample:.4g} is over the campaign's "
                f"bound {max_grad_norm:.4g}; the gradient is likely corrupt",
                lease_id=ticket.lease_id,
            )


def spooled_check_and_sketch(
    file: SpoolFile, ticket: Ticket, max_grad_norm: float, seed: int | None
) -> tuple[torch.Tensor, mmap.mmap, bytes]:
    """``check_and_sketch`` of an upload written to the spool: its mapping, with the pages read given back."""
    grad, pages = file.map_fp32()
    try:
        _, sketched = check_and_sketch(grad, ticket, max_grad_norm, seed)
    finally:
        release_pages(pages)
    return grad, pages, sketched


def decode_check_and_keep(
    codec: Codec,
    data: bytearray,
    num_elements: int,
    ticket: Ticket,
    max_grad_norm: float,
    seed: int | None,
    spool: Spool | None,
) -> tuple[torch.Tensor, mmap.mmap | None, bytes]:
    """``decode_gradient`` and ``check_and_sketch``, then the gradient moved to ``spool`` if it takes it (none:
    kept in memory)."""
    grad = decode_gradient(codec, data, num_elements, ticket)
    grad, sketched = check_and_sketch(grad, ticket, max_grad_norm, seed)
    if spool is None:
        return grad, None, sketched
    grad, pages = spool.keep(grad)
    return grad, pages, sketched


class UploadSession:
    """One agent connection on ``/upload``; handles its uploads one after another."""

    def __init__(self, node: AggregatorNode, ws: UploadSocket) -> None:
        self.node = node
        self.ws = ws
        self._next_text: str | None = None  # a text frame that arrived where a chunk was due
        # The protocol minor the agent and this aggregator agreed on (UploadHandler's handshake).
        self.minor = negotiated_minor(ws.subprotocol)
        self._unknown_noted = False

    async def run(self) -> None:
        """Serve uploads until the agent hangs up or breaks the framing."""
        discarding = False
        rejections = 0
        first = True
        while True:
            if self._next_text is not None:
                raw: str | bytes = self._next_text
                self._next_text = None
            else:
                # Agents send their first header as soon as they connect; between uploads a
                # connection may idle (it is kept for the next lease), watched by keepalive pings.
                timeout = self.node.config.header_timeout_s if first else None
                try:
                    async with asyncio.timeout(timeout):
                        raw = await self.ws.recv()
                except SocketClosed:
                    return
                except TimeoutError:
                    logger.info(
                        "closing upload connection from %s: no upload header within %g s",
                        self.ws.remote_address,
                        timeout,
                    )
                    await self._close(CloseCode.BAD_MESSAGE, f"no upload header within {timeout:g} s of connecting")
                    return
            first = False
            if isinstance(raw, bytes):
                if discarding:
                    continue  # the rest of a rejected upload
                await self._close(CloseCode.BAD_MESSAGE, "binary frame with no upload announced")
                return
            discarding = False
            reply: UploadReceipt | UploadRejected
            try:
                reply = await self._upload(raw)
            except Rejected as rej:
                rejections += 1
                discarding = rej.discard
                self.node.metrics.upload_rejected(rej.code)
                if self.minor >= UPLOAD_REFUSED_SINCE:  # an older agent does not check its gradient first
                    self.node.note_refusal(rej.campaign_id, rej.lease_id, rej.slice_index, rej.code, rej.detail)
                logger.debug(
                    "upload rejected (%s): %s", rej.code, rej.detail,
                    extra={"lease_id": rej.lease_id, "slice_index": rej.slice_index},
                )  # fmt: skip
                reply = UploadRejected(
                    lease_id=rej.lease_id, slice_index=rej.slice_index, code=rej.code, detail=rej.detail
                )
            except ProtocolError as exc:
                # The chunk framing itself is broken: nothing after it can be trusted.
                logger.info("closing upload connection from %s: %s", self.ws.remote_address, exc)
                await self._close(exc.close_code, str(exc))
                return
            else:
                rejections = 0
            try:
                await self.ws.send(encode_message(reply, self.minor))
            except SocketClosed:
                return
            if rejections >= MAX_REJECTIONS_IN_A_ROW:
                await self._close(CloseCode.TOO_MANY_ERRORS, f"{rejections} rejected uploads in a row")
                return

    def _note_unknown(self, kind: str, fields: list[str]) -> None:
        if not self._unknown_noted:  # once per connection: a newer agent, worth a line, not one per upload
            self._unknown_noted = True
            logger.info(
                "an agent at %s sends fields this aggregator does not know (%s: %s); ignored",
                self.ws.remote_address,
                kind,
                ", ".join(fields[:5]),
            )

    async def _close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason.encode()[:120].decode(errors="ignore"))

    async def _upload(self, text: str) -> UploadReceipt:
        """Validate the header, receive the chunks, check the gradient, keep it pending.

        Raises:
            Rejected: anything wrong with this upload alone.
            ProtocolError: a broken chunk header (fatal for the connection).
        """
        # 1. the header and its ticket
        try:
            begin = decode_message(text, allowed=AGENT_TO_AGGREGATOR, unknown=self._note_unknown)
        except ProtocolError as exc:
            raise Rejected(_message_error_code(text, exc), str(exc)) from None
        index = begin.slice_index
        if self.node.ticket_key is None:
            raise Rejected(
                "busy", "aggregator is not connected to the site yet; retry in a few seconds", slice_index=index
            )
        try:
            # Each campaign has its own key: the ticket's unverified campaign id only picks which.
            campaign_id = ticket_campaign(begin.ticket)
            key = self.node.campaign_key(campaign_id)
            if key is None:
                raise Rejected(
                    "slice not held",
                    f"this aggregator holds no slice of campaign {campaign_id}, "
                    "so it cannot check its tickets; check the lease's slice routes",
                    slice_index=index,
                )
            ticket = verify_ticket(begin.ticket, key)
        except ProtocolError as exc:
            raise Rejected("bad ticket", str(exc), slice_index=index) from None
        lease = ticket.lease_id

        def reject(code: str, detail: str, *, discard: bool = True) -> Rejected:
            return Rejected(
                code, detail, lease_id=lease, slice_index=index, campaign_id=ticket.campaign_id, discard=discard
            )

        if ticket.num_samples <= 0:
            raise reject("bad ticket", f"ticket for lease {lease} has {ticket.num_samples} samples")
        state = self.node.get_slice(ticket.campaign_id, index)
        if state is None:
            raise reject(
                "slice not held",
                f"this aggregator holds no slice {index} of campaign "
                f"{ticket.campaign_id}; check the lease's slice routes",
            )
        wanted = state.assignment.codec
        if wanted is not None and begin.codec != wanted:
            raise reject(
                "wrong codec",
                f"campaign {ticket.campaign_id} takes {wanted} gradients, this upload is "
                f"{begin.codec}; send it with the lease's codec",
            )
        block_size = state.assignment.codec_block_size
        if begin.codec == "int8" and begin.codec_block_size != block_size:
            raise reject(
                "wrong codec",
                f"campaign {ticket.campaign_id} takes int8 gradients in blocks of {block_size}, this upload "
                f"is in blocks of {begin.codec_block_size}; send it with the lease's codec_block_size",
            )
        codec = get_codec(begin.codec, block_size)
        if begin.num_elements != state.numel:
            raise reject(
                "wrong shape",
                f"slice {index} has {state.numel} elements, upload announces "
                f"{begin.num_elements}; the agent may run an older model definition, upgrade "
                "crowdtrain-agent",
            )
        nbytes = codec.encoded_size(state.numel)
        expected_chunks = max(1, -(-nbytes // CHUNK_PAYLOAD_BYTES))
        if begin.num_chunks != expected_chunks:
            raise reject(
                "wrong chunk count",
                f"{nbytes} payload bytes make {expected_chunks} chunks of "
                f"{CHUNK_PAYLOAD_BYTES} bytes, upload announces {begin.num_chunks}; cut the payload "
                "with protocol.split_payload",
            )
        try:
            if ticket.check:
                state.check_replay(lease)  # a verification copy is never kept, so no version window
            else:
                state.begin_upload(lease, ticket.base_version)
        except UploadRefused as exc:
            raise reject(exc.code, exc.detail) from None
        held_bytes = state.numel * 4  # kept as fp32 whatever the wire codec
        if not self.node.budget.try_reserve(held_bytes):
            state.abort_upload(lease)
            raise reject(
                "busy",
                f"aggregator holds {self.node.budget.used} pending bytes (limit "
                f"{self.node.budget.limit}); retry after the next step",
            )

        # 2. the chunks, 3. the gradient checks; any failure gives the reservation back. A large fp32
        # upload goes straight to a spool file as it arrives; others are reassembled here, then decoded.
        spool = self.node.spool
        file = spool.open(nbytes) if codec.name == "fp32" and spool.wants(nbytes) else None
        try:
            try:
                data = await self._receive(ticket, begin, nbytes, file)
            except Rejected as exc:
                raise reject(exc.code, exc.detail, discard=exc.discard) from None
            max_norm = state.assignment.max_grad_norm
            seed = sketch_seed(key, index, ticket.base_version) if self.node.site_minor >= 2 else None
            keep_in = None if ticket.check else spool  # a verification copy is sketched, then let go
            work: Callable[[], tuple[torch.Tensor, mmap.mmap | None, bytes]]
            if file is not None:
                work = functools.partial(spooled_check_and_sketch, file, ticket, max_norm, seed)
            else:
                work = functools.partial(
                    decode_check_and_keep, codec, data, state.numel, ticket, max_norm, seed, keep_in
                )
            grad, pages, sketched = await asyncio.to_thread(work) if nbytes >= THREAD_DECODE_BYTES else work()
            if self.node.get_slice(ticket.campaign_id, index) is not state:
                raise reject(
                    "slice not held",
                    f"slice {index} of campaign {ticket.campaign_id} was unassigned during the upload",
                    discard=False,
                )
            if ticket.check:
                state.note_checked(lease)
                self.node.budget.release(held_bytes)  # sketched; the gradient itself is not needed
            else:
                try:
                    state.add_pending(PendingUpload(lease, ticket.base_version, ticket.num_samples, grad, pages=pages))
                except UploadRefused as exc:
                    raise reject(exc.code, exc.detail, discard=False) from None
        except BaseException as exc:
            if file is not None:
                file.close()  # nothing if it was mapped: the mapping goes with the gradient
            state.abort_upload(lease)
            self.node.budget.release(held_bytes)
            if isinstance(exc, Rejected):
                exc.lease_id, exc.slice_index = lease, index
            raise

        self.node.metrics.upload_accepted(nbytes)
        logger.debug(
            "campaign %s slice %s: lease %s pending (%s samples)", ticket.campaign_id, index, lease, ticket.num_samples,
            extra={"campaign_id": ticket.campaign_id, "slice_index": index, "lease_id": lease},
        )  # fmt: skip
        token = sign_receipt(
            key,
            campaign_id=ticket.campaign_id,
            lease_id=lease,
            slice_index=index,
            num_samples=ticket.num_samples,
            sketch=sketched,
        )
        return UploadReceipt(lease_id=lease, slice_index=index, token=token)

    async def _receive(self, ticket: Ticket, begin: UploadBegin, nbytes: int, file: SpoolFile | None) -> bytearray:
        """Reassemble the announced chunks, each ``CHUNK_PAYLOAD_BYTES`` long but the last, in order.

        Into ``file`` when there is one (the bytes returned are then empty), into memory otherwise.
        """
        data = bytearray(nbytes if file is None else 0)
        offset = 0
        lease = ticket.lease_id
        for i in range(begin.num_chunks):
            try:
                async with asyncio.timeout(CHUNK_TIMEOUT_S):
                    raw = await self.ws.recv()
            except SocketClosed:
                raise Rejected("incomplete upload", "connection closed mid-upload", discard=False) from None
            except TimeoutError:
                raise Rejected(
                    "incomplete upload",
                    f"lease {lease}: no chunk {i} within {CHUNK_TIMEOUT_S:.0f} s; upload the slice again",
                ) from None
            if isinstance(raw, str):
                self._next_text = raw  # the agent gave up on this upload and started the next one
                raise Rejected(
                    "incomplete upload",
                    f"lease {lease}: expected chunk {i} of {begin.num_chunks}, got a text message",
                    discard=False,
                )
            header, payload = decode_chunk(raw)  # ProtocolError: broken framing, closes the socket
            if header.chunk_index != i or header.num_chunks != begin.num_chunks:
                raise Rejected(
                    "wrong chunk count",
                    f"lease {lease}: expected chunk {i} of {begin.num_chunks}, got chunk {header.chunk_index} "
                    f"of {header.num_chunks}; send chunks in order",
                )
            want = min(CHUNK_PAYLOAD_BYTES, nbytes - offset)
            if header.payload_len != want:
                raise Rejected(
                    "wrong chunk size", f"lease {lease}: chunk {i} carries {header.payload_len} bytes, expected {want}"
                )
            if file is None:
                data[offset : offset + want] = payload
            else:
                file.write(offset, payload)
            offset += want
        return data


class UploadHandler:
    """Answers ``/upload``: the WebSocket handshake, then an ``UploadSession`` on the socket it opens."""

    def __init__(self, node: AggregatorNode) -> None:
        self.node = node
        self._open: set[web.WebSocketResponse] = set()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        # Offers as RFC 6455 lists them: comma-separated, in one header or several.
        offered = [
            offer.strip()
            for header in request.headers.getall(hdrs.SEC_WEBSOCKET_PROTOCOL, ())
            for offer in header.split(",")
            if offer.strip()
        ]
        try:
            chosen, _minor = choose_subprotocol(offered)
        except SubprotocolError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        ws = web.WebSocketResponse(
            protocols=(chosen,) if chosen else (),
            heartbeat=PING_INTERVAL_S,
            compress=False,  # gradients do not compress; deflate would only burn CPU
            max_msg_size=MAX_WS_MESSAGE_BYTES,
            writer_limit=WRITE_LIMIT_BYTES,
        )
        if not ws.can_prepare(request).ok:
            return web.json_response({"error": "upload is a WebSocket: connect with Upgrade: websocket"}, status=426)
        await ws.prepare(request)
        self._open.add(ws)
        try:
            await UploadSession(self.node, UploadSocket(ws, request.remote)).run()
        finally:
            self._open.discard(ws)
            await ws.close()
        return ws

    async def close_all(self, _app: web.Application) -> None:
        """Close every upload socket: the server is stopping (agents retry their uploads elsewhere or later)."""
        closing = [ws.close(code=WSCloseCode.GOING_AWAY, message=b"aggregator stopping") for ws in self._open]
        await asyncio.gather(*closing, return_exceptions=True)  # at once: each waits for its agent's reply

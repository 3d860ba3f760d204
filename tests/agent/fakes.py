"""Small in-test stand-ins for the site and the aggregators, speaking the real protocol.

Both are `websockets` servers on 127.0.0.1 with a random port. Plain HTTP GETs
(shards on the site, parameter slices on an aggregator) are answered from
``process_request`` so one port serves both, as daphne does for the site.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

import numpy as np
import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.data import sha256_hex
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import (
    AGENT_TO_SITE,
    CONNECTION_HEADER,
    AgentHello,
    CodecName,
    DataSpec,
    DeviceControls,
    DoneAck,
    Heartbeat,
    Lease,
    LeaseDone,
    LeaseRelease,
    LeaseRequest,
    ModelSpec,
    NoLease,
    OptimizerSpec,
    ReleaseAck,
    SampleRange,
    SliceRoute,
    Ticket,
    TrainingMode,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    VersionPublished,
    Welcome,
    choose_subprotocol,
    decode_chunk,
    decode_message,
    encode_message,
    sign_receipt,
    sign_ticket,
    verify_ticket,
)
from tests.shards import make_tensor_shards

TICKET_KEY = b"k" * 32
GOOD_TOKEN = "good-token"
MLP_CONFIG = {"in_dim": 6, "hidden": [8], "classes": 3}


def _binary(status: int, body: bytes, etag: str = "") -> Response:
    headers = Headers(
        [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body))), ("Connection", "close")]
    )
    if etag:
        headers["ETag"] = etag
    return Response(status, HTTPStatus(status).phrase, headers, body)


def _port(server: Server) -> int:
    return int(next(iter(server.sockets)).getsockname()[1])


@dataclass
class FakeSite:
    """The site's control channel and shard endpoint."""

    token: str = GOOD_TOKEN
    heartbeat_s: float = 0.2
    replies: list[Lease | NoLease] = field(default_factory=list)
    shards: dict[str, bytes] = field(default_factory=dict)
    close_code: int | None = None  # close every connection with this code right after the hello
    drop_after_done: bool = False  # drop the TCP connection once, after answering the first done
    verification: str = ""  # what each done_ack says of verification ("pending", "check")
    negotiates: bool = False  # pick this code's minor from the agent's offers (else: a 2.0 site, minor 0)
    controls: DeviceControls | None = None  # what the welcome says of the volunteer's controls (2.8)
    shard_delay_s: float = 0.0
    held_shards: dict[str, asyncio.Event] = field(default_factory=dict)  # answered once their event is set
    refuse_handshakes: list[int] = field(default_factory=list)  # answer the next handshakes with these HTTP statuses
    tries: list[str | None] = field(default_factory=list)  # each handshake's CONNECTION_HEADER, refused ones too
    received: list[Any] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)
    hellos: list[AgentHello] = field(default_factory=list)
    shard_requests: list[str] = field(default_factory=list)
    connections: int = 0
    lease_sent: asyncio.Event = field(default_factory=asyncio.Event)
    current: ServerConnection | None = None
    server: Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{_port(self.server)}"  # type: ignore[arg-type]

    def _select_subprotocol(self, ws: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        return _select_subprotocol(ws, offered) if self.negotiates else None

    async def start(self) -> None:
        self.server = await serve(
            self._handle, "127.0.0.1", 0, process_request=self._http, select_subprotocol=self._select_subprotocol
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def of_kind(self, cls: type) -> list[Any]:
        return [m for m in self.received if isinstance(m, cls)]

    async def push_version(self, campaign_id: int, version: int) -> None:
        if self.current is not None:
            pushed = VersionPublished(campaign_id=campaign_id, version=version, loss=1.5)
            await self.current.send(encode_message(pushed))

    async def push(self, message: Any) -> None:
        """Send ``message`` to the connected agent, as the site pushes a new version or changed controls."""
        if self.current is not None:
            await self.current.send(encode_message(message))

    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path.startswith("/ws/"):
            self.tries.append(request.headers.get(CONNECTION_HEADER))
            if self.refuse_handshakes:
                return _binary(self.refuse_handshakes.pop(0), b"busy")
            return None
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _binary(401, b'{"error": "bad token"}')
        sha = request.path.rsplit("/", 1)[-1]
        self.shard_requests.append(sha)
        if self.shard_delay_s:
            await asyncio.sleep(self.shard_delay_s)
        if sha in self.held_shards:
            await self.held_shards[sha].wait()
        if not request.path.startswith("/api/shards/") or sha not in self.shards:
            return _binary(404, b'{"error": "unknown shard"}')
        return _binary(200, self.shards[sha])

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        if ws.request.headers.get("Authorization") != f"Bearer {self.token}":
            await ws.close(4001, "bad token")
            return
        self.hellos.append(decode_message(await ws.recv(), allowed=[AgentHello]))
        if self.close_code is not None:
            await ws.close(self.close_code, "go away")
            return
        welcome = Welcome(
            device_id=1,
            device_name="laptop",
            volunteer="ada",
            heartbeat_s=self.heartbeat_s,
            gone_after_s=10,
            controls=self.controls,
        )
        await ws.send(encode_message(welcome))
        self.current = ws
        async for raw in ws:
            message = decode_message(raw, allowed=AGENT_TO_SITE)
            if isinstance(message, Heartbeat):
                self.heartbeats.append(time.monotonic())
                continue
            self.received.append(message)
            if isinstance(message, LeaseRequest):
                reply = (
                    self.replies.pop(0)
                    if self.replies
                    else NoLease(reason="campaign_finished", detail="nothing left", retry_after_s=30.0)
                )
                await ws.send(encode_message(reply))
                if isinstance(reply, Lease):
                    self.lease_sent.set()
            elif isinstance(message, LeaseDone):
                ack = DoneAck(lease_id=message.lease_id, accepted=True, step=0, verification=self.verification)
                await ws.send(encode_message(ack))
                if self.drop_after_done:
                    self.drop_after_done = False
                    ws.transport.abort()  # a crash, not a close: no close frame at all
                    return
            elif isinstance(message, LeaseRelease):
                await ws.send(encode_message(ReleaseAck(lease_id=message.lease_id)))


def _select_subprotocol(_: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    return cast("Subprotocol | None", choose_subprotocol(list(offered))[0])


@dataclass
class FakeAggregator:
    """One aggregator: serves parameter slices over HTTP and takes gradient uploads."""

    params: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (slice, version) -> fp32 bytes
    missing_first: int = 0  # answer this many parameter GETs with 404 first ("not published yet")
    slow_versions: dict[int, float] = field(default_factory=dict)  # version -> seconds before answering
    reject_code: str | None = None
    uploads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (lease, slice) -> gradient
    upload_bytes: dict[int, int] = field(default_factory=dict)  # lease -> bytes of the chunk messages received
    param_requests: list[str] = field(default_factory=list)  # paths, without the query
    param_queries: list[str] = field(default_factory=list)  # the query of each GET ("from=3"), "" without one
    param_downloads: int = 0  # answers with a body (a 304 to a revalidation is not one)
    param_auth: list[str | None] = field(default_factory=list)  # the Authorization header of each GET
    connections: int = 0
    server: Server | None = None

    @property
    def upload_url(self) -> str:
        return f"ws://127.0.0.1:{_port(self.server)}/upload"  # type: ignore[arg-type]

    def params_url(self, slice_index: int) -> str:
        return f"http://127.0.0.1:{_port(self.server)}/params/{slice_index}/"  # type: ignore[arg-type]

    async def start(self) -> None:
        # Speaks this code's minor, as a real aggregator does (its upload headers carry 2.3's codec_block_size).
        self.server = await serve(
            self._handle, "127.0.0.1", 0, process_request=self._http, select_subprotocol=_select_subprotocol
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/upload":
            return None
        # Like an aggregator older than deltas: a query (``?from=``) is ignored, the answer is fp32.
        path, _, query = request.path.partition("?")
        self.param_requests.append(path)
        self.param_queries.append(query)
        self.param_auth.append(request.headers.get("Authorization"))
        _, _, slice_index, version = path.split("/")
        await asyncio.sleep(self.slow_versions.get(int(version), 0.0))
        if self.missing_first > 0:
            self.missing_first -= 1
            return _binary(404, b'{"error": "unknown version"}')
        data = self.params.get((int(slice_index), int(version)))
        if data is None:
            return _binary(404, b'{"error": "unknown version"}')
        etag = (
            f'"{slice_index}-{version}-{hashlib.sha256(data).hexdigest()[:16]}"'  # like the real one: per publication
        )
        if request.headers.get("If-None-Match") == etag:
            return _binary(304, b"", etag)
        self.param_downloads += 1
        return _binary(200, data, etag)

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        async for raw in ws:
            begin = decode_message(raw, allowed=[UploadBegin])
            ticket = verify_ticket(begin.ticket, TICKET_KEY)
            chunks = [await ws.recv() for _ in range(begin.num_chunks)]
            self.upload_bytes[ticket.lease_id] = self.upload_bytes.get(ticket.lease_id, 0) + sum(map(len, chunks))
            payload = b"".join(bytes(decode_chunk(chunk)[1]) for chunk in chunks)
            if self.reject_code is not None:
                rejected = UploadRejected(
                    lease_id=ticket.lease_id, slice_index=begin.slice_index, code=self.reject_code, detail="test"
                )
                await ws.send(encode_message(rejected))
                continue
            grad = get_codec(begin.codec, begin.codec_block_size).decode(payload, begin.num_elements)
            self.uploads[(ticket.lease_id, begin.slice_index)] = grad
            token = sign_receipt(
                TICKET_KEY, campaign_id=ticket.campaign_id, lease_id=ticket.lease_id,
                slice_index=begin.slice_index, num_samples=ticket.num_samples,
            )  # fmt: skip
            receipt = UploadReceipt(lease_id=ticket.lease_id, slice_index=begin.slice_index, token=token)
            await ws.send(encode_message(receipt))


@dataclass
class World:
    """A campaign with one shard and two parameter slices on two aggregators."""

    site: FakeSite
    aggregators: list[FakeAggregator]
    shard: bytes
    sha: str
    x: torch.Tensor
    y: torch.Tensor
    params: torch.Tensor
    split: int

    def routes(self) -> list[SliceRoute]:
        bounds = [(0, self.split), (self.split, self.params.numel())]
        return [
            SliceRoute(index=i, start=lo, end=hi, upload_url=agg.upload_url, params_url=agg.params_url(i))
            for i, ((lo, hi), agg) in enumerate(zip(bounds, self.aggregators, strict=True))
        ]

    def lease(
        self,
        lease_id: int,
        ranges: list[tuple[int, int]],
        *,
        version: int = 0,
        microbatch: int = 4,
        codec: CodecName = "fp32",
        codec_block_size: int = 256,
        mode: TrainingMode = "sync",
        inner: OptimizerSpec | None = None,
        rebase_to: int | None = None,
    ) -> Lease:
        sample_ranges = [SampleRange(shard=self.sha, start=s, count=c) for s, c in ranges]
        num = sum(c for _, c in ranges)
        ticket = Ticket(
            lease_id=lease_id, campaign_id=7, device_id=1, base_version=version, num_samples=num,
            expires_at=time.time() + 600,
        )  # fmt: skip
        return Lease(
            lease_id=lease_id, campaign_id=7, base_version=version, ranges=sample_ranges, num_samples=num,
            microbatch_size=microbatch, deadline_s=60.0, ticket=sign_ticket(ticket, TICKET_KEY), codec=codec,
            model=ModelSpec(architecture="mlp", config=MLP_CONFIG), data=DataSpec(kind="tensors"),
            param_count=self.params.numel(), slices=self.routes(), codec_block_size=codec_block_size,
            mode=mode, inner=inner, rebase_to=rebase_to,
        )  # fmt: skip

    def samples(self, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.cat([torch.arange(s, s + c) for s, c in ranges])
        return self.x[idx], self.y[idx]

    def expected_gradient(self, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Plain PyTorch: sum of per-sample cross-entropy over the lease's samples, one backward."""
        model = get_model("mlp").build(MLP_CONFIG)
        torch.nn.utils.vector_to_parameters(self.params.clone(), model.parameters())
        x, y = self.samples(ranges)
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


async def make_world(num_samples: int = 40) -> World:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_samples, MLP_CONFIG["in_dim"])).astype(np.float32)
    y = rng.integers(0, MLP_CONFIG["classes"], num_samples).astype(np.int64)
    ((shard, _),) = list(make_tensor_shards(x, y, num_samples))
    sha = sha256_hex(shard)
    params = torch.nn.utils.parameters_to_vector(get_model("mlp").build(MLP_CONFIG, seed=1).parameters()).detach()
    split = params.numel() // 2
    site = FakeSite(shards={sha: shard})
    aggregators = [FakeAggregator(), FakeAggregator()]
    flat = params.numpy().astype("<f4")
    aggregators[0].params[(0, 0)] = flat[:split].tobytes()
    aggregators[1].params[(1, 0)] = flat[split:].tobytes()
    await site.start()
    for agg in aggregators:
        await agg.start()
    return World(site, aggregators, shard, sha, torch.from_numpy(x), torch.from_numpy(y), params, split)

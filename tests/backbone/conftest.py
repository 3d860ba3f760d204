"""Fixtures for the aggregator tests: a fake site, a running aggregator, and a scripted agent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from crowdtrain_agent.backoff import Backoff
from crowdtrain_agent.codec import CODECS, get_codec
from crowdtrain_agent.protocol import (
    BackboneHello,
    BackboneWelcome,
    CheckpointSaved,
    Heartbeat,
    ModelSpec,
    OptimizerSpec,
    SliceAssignment,
    SliceReady,
    SliceRoute,
    StepApplied,
    StepCommit,
    Ticket,
    UploadBegin,
    UploadReceipt,
    UploadRejected,
    campaign_key,
    decode_message,
    encode_message,
    sign_ticket,
    split_payload,
    verify_receipt,
)
from crowdtrain_backbone.config import BackboneConfig
from crowdtrain_backbone.server import BackboneServer

M = TypeVar("M")

KEY = b"test-ticket-key-0123456789abcdef"
SITE_TOKEN = "site-token"
MLP = ModelSpec(architecture="mlp", config={"in_dim": 4, "hidden": [8], "classes": 3})
MLP_PARAMS = 4 * 8 + 8 + 8 * 3 + 3  # 67
SLICE0 = (0, 40)
# Reconnects within a test's patience; like the real aggregator's, it never gives up.
FAST_BACKOFF = Backoff(base_s=0.02, max_s=0.1, max_tries=None)
SLICE1 = (40, MLP_PARAMS)


def assignment(
    *,
    campaign_id: int = 1,
    slice_index: int = 0,
    bounds: tuple[int, int] = SLICE0,
    version: int = 0,
    staleness: int = 1,
    checkpoint_every: int = 0,
    max_grad_norm: float = 0.0,
    optimizer: OptimizerSpec | None = None,
    model: ModelSpec = MLP,
    param_count: int = MLP_PARAMS,
    seed: int = 1234,
    restore_version: int | None = None,
    **robust: Any,
) -> SliceAssignment:
    """A site's assignment; ``robust``: aggregation, clip_factor, trim_fraction (protocol defaults if left out)."""
    return SliceAssignment(
        campaign_id=campaign_id, slice_index=slice_index, start=bounds[0], end=bounds[1],
        param_count=param_count, model=model, optimizer=optimizer or OptimizerSpec(name="adamw", lr=1e-2),
        seed=seed, version=version, staleness=staleness, checkpoint_every=checkpoint_every,
        max_grad_norm=max_grad_norm, restore_version=restore_version,
        ticket_key=campaign_key(KEY, campaign_id).hex(),  # as a 2.1 site sends it
        **robust,
    )  # fmt: skip


def ticket(
    lease_id: int,
    *,
    campaign_id: int = 1,
    base_version: int = 0,
    num_samples: int = 4,
    expires_in: float = 60.0,
    key: bytes | None = None,
) -> str:
    """A ticket signed as the site signs it: with the campaign's key (``key`` overrides it)."""
    return sign_ticket(
        Ticket(lease_id=lease_id, campaign_id=campaign_id, device_id=1, base_version=base_version,
               num_samples=num_samples, expires_at=time.time() + expires_in),
        campaign_key(KEY, campaign_id) if key is None else key,
    )  # fmt: skip


def set_mean_gradient(params: list[torch.nn.Parameter], leases: dict[int, tuple[torch.Tensor, int]]) -> None:
    """What one big machine does for a step: sum the leases' gradients in lease-id order, divide by the
    step's samples, and put the result in each parameter's ``.grad``."""
    total = torch.zeros(sum(p.numel() for p in params))
    for lease_id in sorted(leases):
        total.add_(leases[lease_id][0])
    total.div_(float(sum(n for _, n in leases.values())))
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def decay_groups(model: torch.nn.Module, weight_decay: float, *, decay_all: bool = False) -> list[dict[str, Any]]:
    """Plain PyTorch param groups with the aggregators' weight-decay rule (nanoGPT's): matrices and
    embeddings decay, biases and norm gains (fewer than 2 dimensions) do not, unless ``decay_all``."""
    params = list(model.parameters())
    decayed = [p for p in params if decay_all or p.dim() >= 2]
    kept = [p for p in params if not (decay_all or p.dim() >= 2)]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def gradient(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


class FakeSite:
    """Plays the site's ``/ws/backbone/`` end: welcomes the aggregator, records what it sends."""

    def __init__(self) -> None:
        self.url = ""
        self.hello: BackboneHello | None = None
        self.ws: ServerConnection | None = None
        self.connections = 0
        self.heartbeats = 0
        self.close_with: int | None = None  # close new connections with this code instead of welcoming
        self.refuse_handshakes: list[int] = []  # answer the next handshakes with these HTTP statuses
        self.refused = 0
        self.welcome_key = b""  # what the welcome's ticket_key carries: nothing, as from a 2.1 site
        self.connected = asyncio.Event()
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self.checkpoints: list[CheckpointSaved] = []  # kept apart: they follow the replies tests wait for

    def process_request(self, ws: ServerConnection, request: Request) -> Response | None:
        if not self.refuse_handshakes:
            return None
        self.refused += 1
        return ws.respond(self.refuse_handshakes.pop(0), "busy\n")

    async def handler(self, ws: ServerConnection) -> None:
        if ws.request is None or ws.request.headers.get("Authorization") != f"Bearer {SITE_TOKEN}":
            await ws.close(4001, "bad token")
            return
        self.connections += 1
        if self.close_with is not None:
            await ws.close(self.close_with, "test says no")
            return
        self.hello = decode_message(await ws.recv(), allowed=(BackboneHello,))
        welcome = BackboneWelcome(aggregator_id=7, ticket_key=self.welcome_key.hex(), heartbeat_s=0.2)
        await ws.send(encode_message(welcome))
        self.ws = ws
        self.connected.set()
        try:
            async for raw in ws:
                message = decode_message(raw)
                if isinstance(message, Heartbeat):
                    self.heartbeats += 1
                elif isinstance(message, CheckpointSaved):
                    self.checkpoints.append(message)
                else:
                    self.received.put_nowait(message)
        except ConnectionClosed:
            pass
        finally:
            self.connected.clear()

    async def send(self, message: Any) -> None:
        if self.ws is None:
            raise RuntimeError("no aggregator connected")
        await self.ws.send(encode_message(message))

    async def expect(self, cls: type[M], timeout: float = 10.0) -> M:
        message = await asyncio.wait_for(self.received.get(), timeout)
        if not isinstance(message, cls):
            raise AssertionError(f"expected {cls.__name__}, got {message!r}")
        return message

    async def call(self, message: Any, cls: type[M]) -> M:
        await self.send(message)
        return await self.expect(cls)

    async def assign(self, order: SliceAssignment) -> SliceReady:
        return await self.call(order, SliceReady)

    async def commit(self, step: int, lease_ids: list[int], num_samples: int, campaign_id: int = 1) -> Any:
        await self.send(StepCommit(campaign_id=campaign_id, step=step, lease_ids=lease_ids, num_samples=num_samples))
        return await asyncio.wait_for(self.received.get(), 10)


class Agent:
    """Plays an agent on the data channel: one connection, many uploads."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def upload(
        self,
        ticket_text: str,
        grad: torch.Tensor,
        *,
        slice_index: int = 0,
        codec: str = "fp32",
        payload: bytes | None = None,
        **header: Any,
    ) -> UploadReceipt | UploadRejected:
        """Upload ``grad`` in ``codec`` (an unknown codec sends fp32 bytes), or ``payload`` as it is."""
        block_size = header.get("codec_block_size", 256)
        if payload is None:
            payload = get_codec(codec if codec in CODECS else "fp32", block_size).encode(grad)
        chunks = split_payload(payload)
        begin = UploadBegin(ticket=ticket_text, slice_index=slice_index, codec=codec,  # type: ignore[arg-type]
                            num_elements=grad.numel(), num_chunks=len(chunks))  # fmt: skip
        begin = msgspec.structs.replace(begin, **header)
        await self.ws.send(encode_message(begin))
        for chunk in chunks:
            await self.ws.send(chunk)
        return await self.reply()

    async def reply(self) -> UploadReceipt | UploadRejected:
        return decode_message(await asyncio.wait_for(self.ws.recv(), 10), allowed=(UploadReceipt, UploadRejected))

    async def good_upload(self, lease_id: int, *, numel: int = SLICE0[1] - SLICE0[0], base_version: int = 0,
                          num_samples: int = 4) -> UploadReceipt:  # fmt: skip
        reply = await self.upload(ticket(lease_id, base_version=base_version, num_samples=num_samples),
                                  gradient(numel, lease_id))  # fmt: skip
        if not isinstance(reply, UploadReceipt):
            raise AssertionError(f"good upload of lease {lease_id} rejected: {reply!r}")
        if not verify_receipt(reply.token, campaign_key(KEY, 1), campaign_id=1, lease_id=lease_id, slice_index=0,
                              num_samples=num_samples):  # fmt: skip
            raise AssertionError("receipt does not verify")
        return reply


def backbone_config(site_url: str, checkpoint_dir: Path, **overrides: Any) -> BackboneConfig:
    """Every upload, however small, goes through the spool here (``spool_min_bytes=0``): the tests' slices
    are far below the default size, and the spool is the path large models take."""
    settings: dict[str, Any] = {"spool_dir": checkpoint_dir.parent / "spool", "spool_min_bytes": 0, **overrides}
    return BackboneConfig(
        site=site_url, token=SITE_TOKEN, name="agg-test", host="127.0.0.1", port=0,
        checkpoint_dir=checkpoint_dir, public_host="127.0.0.1", **settings,
    )  # fmt: skip


@pytest.fixture
async def site() -> AsyncIterator[FakeSite]:
    fake = FakeSite()
    async with serve(fake.handler, "127.0.0.1", 0, process_request=fake.process_request) as server:
        fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        yield fake


@asynccontextmanager
async def running_backbone(site: FakeSite, checkpoint_dir: Path, **overrides: Any) -> AsyncIterator[BackboneServer]:
    server = BackboneServer(backbone_config(site.url, checkpoint_dir, **overrides), backoff=FAST_BACKOFF)
    await server.start()
    try:
        await asyncio.wait_for(site.connected.wait(), 10)
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def backbone(site: FakeSite, tmp_path: Path) -> AsyncIterator[BackboneServer]:
    async with running_backbone(site, tmp_path / "checkpoints") as server:
        yield server


@asynccontextmanager
async def agent_connection(server: BackboneServer, subprotocols: list[str] | None = None) -> AsyncIterator[Agent]:
    """An agent's upload connection; ``subprotocols``: what it offers (none: a 2.0 agent)."""
    offered = [Subprotocol(p) for p in subprotocols] if subprotocols else None
    async with connect(f"ws://127.0.0.1:{server.port}/upload", max_size=None, subprotocols=offered) as ws:
        yield Agent(ws)


@pytest.fixture
async def agent(backbone: BackboneServer) -> AsyncIterator[Agent]:
    async with agent_connection(backbone) as connected:
        yield connected


@pytest.fixture
async def held(site: FakeSite, backbone: BackboneServer) -> SliceReady:
    """Slice 0 of campaign 1 assigned at version 0."""
    return await site.assign(assignment())


async def take_step(site: FakeSite, agent: Agent, version: int, lease_id: int) -> StepApplied:
    """Upload one lease at ``version`` and commit it, advancing the slice by one version."""
    await agent.good_upload(lease_id, base_version=version)
    reply = await site.commit(version, [lease_id], 4)
    if not isinstance(reply, StepApplied):
        raise AssertionError(f"step {version} failed: {reply!r}")
    return reply


# Big enough that a step's XOR compresses below fp32 (a 40-element slice is mostly zstd's frame).
TWO_SLICE_MODEL = ModelSpec(architecture="mlp", config={"in_dim": 16, "hidden": [64], "classes": 10})
TWO_SLICE_PARAMS = 16 * 64 + 64 + 64 * 10 + 10  # 1738
TWO_SLICE_BOUNDS = [(0, 1000), (1000, TWO_SLICE_PARAMS)]


@pytest.fixture
async def two_slices(site: FakeSite, backbone: BackboneServer) -> list[SliceRoute]:
    """Campaign 1's ``TWO_SLICE_MODEL`` in two slices, both on this aggregator, at version 0."""
    for index, bounds in enumerate(TWO_SLICE_BOUNDS):
        order = assignment(slice_index=index, bounds=bounds, model=TWO_SLICE_MODEL, param_count=TWO_SLICE_PARAMS)
        await site.call(order, SliceReady)
    return [
        SliceRoute(index=i, start=lo, end=hi, upload_url="ws://unused", params_url=f"{backbone.url}/params/1/{i}/")
        for i, (lo, hi) in enumerate(TWO_SLICE_BOUNDS)
    ]

"""The tab's page and worker go through a lease as the agent does, against a stand-in site and aggregator.

The stand-in speaks the contract of issue 36's other parts (POST /devices/tab/, the bearer subprotocol,
/api/campaigns/<id>/browser/, the graphs, shards, parameters and the upload socket), so the page and its
worker are checked on their own: the page registers the tab and starts the worker; the worker says hello
as a browser, takes a lease, downloads the graph, parameters and shard, computes, uploads each slice,
reports done with the receipts, gives back a lease when paused, and shows a no_lease reason in words.
The real site and aggregator in the loop are the lead's integration test.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import websockets
from playwright.sync_api import Browser, expect
from websockets.asyncio.server import ServerConnection, serve

from tests.browser.tab_support import Family, IsolatedFiles, export_family, gate_check, require_build, serving
from tests.shards import make_tensor_shards

TOKEN = "ctd_" + "T" * 43
TICKET = "dGlja2V0.c2ln"
CAMPAIGN = 7
FLOPS_PER_SAMPLE = 3_000_000  # what the stand-in's browser API says one sample's gradient costs
SAMPLES = 2 * 16 + 3  # mlp's small microbatch is 16: two whole microbatches and three samples one by one

PAGE = """<!doctype html><meta charset="utf-8"><title>tab</title>
<p id="tab-problem" hidden></p><p id="tab-status"></p><p id="tab-speed"></p><p id="tab-leases">0</p>
<p id="tab-credit"></p><button id="tab-pause" disabled>Pause</button>
<script id="tab-config" type="application/json">{config}</script>
<script type="module" src="/build/tab-page.js"></script>"""

# What a browser does when its tab goes to the background or comes back (Playwright's pages stay visible).
HIDE = """() => {{
  Object.defineProperty(document, "visibilityState", {{ configurable: true, get: () => "{state}" }});
  document.dispatchEvent(new Event("visibilitychange"));
}}"""


@pytest.fixture(autouse=True)
def live_site() -> None:
    """No site here (the conftest's autouse fixture starts one): a stand-in serves the tab."""


class StandIn:
    """The site's and the aggregator's side of one tab's session, scripted, with what the tab sent."""

    def __init__(self, family: Family, shard: bytes) -> None:
        self.family = family
        self.shard = shard
        self.shard_sha = hashlib.sha256(shard).hexdigest()
        self.flat = family.flat_params()
        self.half = self.flat.size // 2
        self.offered: list[str] = []
        self.received: list[dict[str, Any]] = []
        self.uploads: dict[tuple[int, int], np.ndarray] = {}
        self.second_download = threading.Event()  # the tab is downloading the second lease's parameters
        self.paused = threading.Event()  # the test clicked Pause: the download may finish
        self.ws_port = 0
        self.memory_bytes = 10_000_000  # what the browser API says the campaign's graph needs in a tab

    def routes(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "start": start, "end": end, "upload_url": f"ws://127.0.0.1:{self.ws_port}/upload",
             "params_url": f"/params/{CAMPAIGN}/{i}/"}
            for i, (start, end) in enumerate([(0, self.half), (self.half, int(self.flat.size))])
        ]  # fmt: skip

    def lease(self, lease_id: int, version: int) -> dict[str, Any]:
        return {
            "kind": "lease", "lease_id": lease_id, "campaign_id": CAMPAIGN, "base_version": version,
            "ranges": [{"shard": self.shard_sha, "start": 0, "count": SAMPLES}], "num_samples": SAMPLES,
            "microbatch_size": self.family.microbatch, "deadline_s": 600, "ticket": TICKET, "codec": "fp32",
            "model": {"architecture": "mlp", "config": self.family.config}, "data": {"kind": "tensors"},
            "param_count": int(self.flat.size), "slices": self.routes(), "mode": "sync",
        }  # fmt: skip

    async def control(self, ws: ServerConnection) -> None:
        self.offered = ws.request.headers.get("Sec-WebSocket-Protocol", "").split(", ") if ws.request else []
        requests = 0
        async for raw in ws:
            message = json.loads(raw)
            self.received.append(message)
            kind = message["kind"]
            if kind == "hello":
                await ws.send(json.dumps({"kind": "welcome", "device_id": 1, "device_name": "Chromium tab",
                                          "volunteer": "vera", "heartbeat_s": 1, "gone_after_s": 60}))  # fmt: skip
            elif kind == "lease_request":
                requests += 1
                if requests <= 2:
                    await ws.send(json.dumps(self.lease(100 + requests, requests)))
                else:
                    await ws.send(json.dumps({"kind": "no_lease", "reason": "epoch_done", "detail": "",
                                              "retry_after_s": 30}))  # fmt: skip
            elif kind == "done":
                await ws.send(json.dumps({"kind": "done_ack", "lease_id": message["lease_id"], "accepted": True,
                                          "step": 1}))  # fmt: skip
            elif kind == "release":
                await ws.send(json.dumps({"kind": "release_ack", "lease_id": message["lease_id"]}))

    async def upload(self, ws: ServerConnection) -> None:
        async for raw in ws:
            begin = json.loads(raw)
            chunks = [await ws.recv() for _ in range(begin["num_chunks"])]
            payload = b"".join(c[16:] for c in chunks if isinstance(c, bytes))
            self.uploads[(1, begin["slice_index"])] = np.frombuffer(payload, dtype="<f4")
            await ws.send(json.dumps({"kind": "receipt", "lease_id": 101, "slice_index": begin["slice_index"],
                                      "token": f"receipt-{begin['slice_index']}"}))  # fmt: skip

    def http_handler(self) -> type[IsolatedFiles]:
        stand_in = self

        class Handler(IsolatedFiles):
            def do_POST(self) -> None:
                if self.path == "/devices/tab/":
                    self.answer(201, json.dumps({"device_id": 1, "token": TOKEN, "name": "tab"}).encode())
                else:
                    self.answer(404, b"{}")

            def do_GET(self) -> None:
                family = stand_in.family
                if self.path.startswith("/params/"):
                    _, _, campaign, index, version = self.path.partition("?")[0].split("/")
                    if version == "2":
                        stand_in.second_download.set()
                        stand_in.paused.wait(30)
                    route = stand_in.routes()[int(index)]
                    body = stand_in.flat[route["start"] : route["end"]].tobytes()
                    self.answer(200, body, {"X-Crowdtrain-Sha256": hashlib.sha256(body).hexdigest()})
                elif self.path == f"/api/shards/{stand_in.shard_sha}":
                    ok = self.headers.get("Authorization") == f"Bearer {TOKEN}"
                    self.answer(200 if ok else 401, stand_in.shard if ok else b"")
                elif self.path == f"/api/campaigns/{CAMPAIGN}/browser/":
                    graphs = {str(g.manifest.microbatch_size): {"sha256": g.sha256, "bytes": len(g.onnx),
                                                                "url": f"/browser/graphs/{g.sha256}.onnx"}
                              for g in (family.graph, family.single)}  # fmt: skip
                    info = {"status": "passed", "reason": "", "microbatch_size": family.microbatch, "graphs": graphs,
                            "manifest": family.manifest.to_dict(), "memory_bytes": stand_in.memory_bytes,
                            "flops_per_sample": FLOPS_PER_SAMPLE}  # fmt: skip
                    self.answer(200, json.dumps(info).encode())
                elif self.path.startswith("/browser/graphs/"):
                    graph = next(g for g in (family.graph, family.single) if g.sha256 in self.path)
                    self.answer(200, graph.onnx)
                else:
                    super().do_GET()

            def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StandIn]]:
    require_build()
    family = export_family("mlp", SAMPLES)
    shard, _ = next(make_tensor_shards(family.x.numpy(), family.y.numpy(), SAMPLES))
    site = StandIn(family, shard)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def route(ws: ServerConnection) -> None:
        await (site.control(ws) if ws.request and ws.request.path == "/ws/agent/" else site.upload(ws))

    async def main() -> None:
        async with serve(route, "127.0.0.1", 0, subprotocols=[websockets.Subprotocol("crowdtrain.2.10")]) as server:
            site.ws_port = server.sockets[0].getsockname()[1]
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    root = tmp_path_factory.mktemp("tab-site")
    try:
        with serving(root, site.http_handler()) as url:
            config = {
                "campaign_id": CAMPAIGN, "user_id": 1, "ws_url": f"ws://127.0.0.1:{site.ws_port}/ws/agent/",
                "shard_url": f"{url}api/shards/", "browser_api_url": f"/api/campaigns/{CAMPAIGN}/browser/",
                "tab_device_url": "/devices/tab/", "worker_url": "/build/tab-worker.js", "ort_url": f"{url}build/ort/",
                "webgpu": False,
            }  # fmt: skip
            (root / "index.html").write_text(PAGE.format(config=json.dumps(config)))
            yield url, site
    finally:
        site.paused.set()
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_a_tab_takes_a_lease_through_to_done_gives_one_back_when_paused_and_says_why_it_waits(
    stand_in: tuple[str, StandIn], browser: Browser
) -> None:
    url, site = stand_in
    page = browser.new_page()
    page.goto(url)

    # the first lease: hello as a browser, graph, parameters, shard, gradient, two slices up, done
    expect(page.locator("#tab-leases")).to_have_text("1", timeout=60_000)
    assert f"crowdtrain.bearer.{TOKEN}" in site.offered and site.offered[0] == "crowdtrain.2.10"
    assert page.evaluate("localStorage.getItem('crowdtrain.tab.token.1')") == TOKEN
    # what the tab trained at is kept for its next visit's hello: samples/s times the FLOPs of a sample
    kept = float(page.evaluate("localStorage.getItem('crowdtrain.tab.flops')"))
    speed = float(page.locator("#tab-speed").inner_text().split()[0])
    assert kept == pytest.approx(speed * FLOPS_PER_SAMPLE, rel=0.01), (kept, speed)
    hello = site.received[0]
    assert hello["kind"] == "hello" and hello["device"]["kind"] == "browser"
    assert hello["device"]["runtime"] == "onnxruntime-web 1.30.0 wasm"
    request = next(m for m in site.received if m["kind"] == "lease_request")
    assert request["campaign_id"] == CAMPAIGN and request["wait_s"] == 10 and len(request["request_id"]) == 32
    done = next(m for m in site.received if m["kind"] == "done")
    assert done["lease_id"] == 101 and done["num_samples"] == SAMPLES
    assert done["receipts"] == [{"slice_index": 0, "token": "receipt-0"}, {"slice_index": 1, "token": "receipt-1"}]
    assert done["bytes_down"] >= len(site.shard) + 4 * site.flat.size and done["bytes_up"] > 4 * site.flat.size
    grad = np.concatenate([site.uploads[(1, 0)], site.uploads[(1, 1)]])
    tab, pytorch, limit = gate_check(site.family, done["loss_sum"], grad)
    assert tab.relative <= limit, (
        f"the uploaded gradient is {tab.relative:.2e} from fp64 (PyTorch {pytorch.relative:.2e})"
    )

    # the second lease: Pause while its parameters download gives it back, and nothing of it is reported
    assert site.second_download.wait(30)
    page.click("#tab-pause")
    expect(page.locator("#tab-pause")).to_have_text("Resume")
    expect(page.locator("#tab-status")).to_contain_text("paused: you paused this tab")
    site.paused.set()
    page.wait_for_timeout(1000)  # the download finishes; a worker that ignored the pause would compute and report
    kinds = [(m["kind"], m.get("lease_id")) for m in site.received]
    assert ("release", 102) in kinds and ("done", 102) not in kinds

    # Resume: the next request is answered no_lease, which the page shows in words
    page.click("#tab-pause")
    expect(page.locator("#tab-status")).to_contain_text(
        "waiting: every sample of this epoch is handed out; waiting for the next epoch", timeout=30_000
    )
    assert sum(kind == "heartbeat" for kind, _ in kinds) >= 1
    requests = [m["request_id"] for m in site.received if m["kind"] == "lease_request"]
    assert len(set(requests)) == len(requests) == 3  # each answered request is followed by a new one
    page.close()


def test_a_model_too_large_for_a_tab_is_refused_in_words_and_no_lease_is_asked(
    stand_in: tuple[str, StandIn], browser: Browser
) -> None:
    url, site = stand_in
    site.memory_bytes = 12_000_000_000
    hellos = sum(m["kind"] == "hello" for m in site.received)
    page = browser.new_page()
    try:
        page.goto(url)
        problem = page.locator("#tab-problem")
        expect(problem).to_be_visible()
        expect(problem).to_contain_text("This campaign's model needs about 12 GB; a tab may use")
        expect(problem).to_contain_text("run the Python agent instead")
        expect(page.locator("#tab-pause")).to_be_disabled()
        page.wait_for_timeout(500)
        assert sum(m["kind"] == "hello" for m in site.received) == hellos, "a tab that cannot hold the model connected"
    finally:
        site.memory_bytes = 10_000_000
        page.close()


def test_a_tab_hidden_for_a_minute_gives_its_lease_back_and_works_again_once_shown(
    stand_in: tuple[str, StandIn], browser: Browser
) -> None:
    """A background tab is throttled and may be discarded: after HIDDEN_RELEASE_S its lease goes to others."""
    url, site = stand_in
    site.second_download.clear()
    site.paused.clear()
    start = len(site.received)
    sent = lambda: [(m["kind"], m.get("lease_id")) for m in site.received[start:]]  # noqa: E731
    page = browser.new_page()
    page.clock.install()  # the page's timers only: the worker keeps real time
    page.add_init_script("localStorage.setItem('crowdtrain.tab.flops', '4500000000')")  # a visit before
    try:
        page.goto(url)
        expect(page.locator("#tab-leases")).to_have_text("1", timeout=60_000)
        assert site.second_download.wait(30), "the tab did not start on its second lease"
        hello = next(m for m in site.received[start:] if m["kind"] == "hello")
        assert hello["device"]["flops_per_s"] == 4.5e9, "the hello did not say what the tab measured before"

        page.evaluate(HIDE.format(state="hidden"))
        page.wait_for_timeout(500)
        assert ("release", 102) not in sent(), "a tab hidden for half a second gave its lease back"
        page.clock.fast_forward("01:01")
        expect(page.locator("#tab-status")).to_contain_text("paused: the tab was hidden for more than a minute")
        for _ in range(50):  # the pause crosses to the worker, the release to the stand-in
            if ("release", 102) in sent():
                break
            page.wait_for_timeout(100)
        assert ("release", 102) in sent(), f"the hidden tab kept its lease: {sent()}"
        site.paused.set()
        page.wait_for_timeout(1000)  # the download ends; a worker that ignored the pause would compute and report
        assert ("done", 102) not in sent()

        requests = sum(kind == "lease_request" for kind, _ in sent())
        page.evaluate(HIDE.format(state="visible"))
        expect(page.locator("#tab-status")).to_contain_text(
            "waiting: every sample of this epoch is handed out", timeout=30_000
        )
        assert sum(kind == "lease_request" for kind, _ in sent()) == requests + 1, "shown again, the tab asked no work"
    finally:
        site.paused.set()
        page.close()

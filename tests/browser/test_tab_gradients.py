"""A browser tab's gradients match PyTorch's within the gate's bar, for each family the gate passes (issue 36).

The graph is the one the site exports (``crowdtrain.browser.graphs``), run in Debian's Chromium by the tab's
own worker bundle (``frontend/static/build/tab-worker.js``, built by ``make charts``) through the module a
lease's gradient takes (``frontend/src/tab/compute.js``): whole microbatches through the graph, the samples
left over through the batch-1 graph, summed into the flat vector. The tab's loss and gradient are measured
against PyTorch fp64 as the gate measures onnxruntime's (``crowdtrain.browser.gate``), and must be within the
gate's bar: ten times PyTorch fp32's own error, counted as at least 1e-6.

These tests need no site: a small HTTP server serves the build, the graphs and the batch, cross-origin
isolated as the site serves the tab.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from playwright.sync_api import Browser, Playwright

from crowdtrain.browser.gate import ERROR_FLOOR, TOLERANCE, deviation, fp64_gradients
from crowdtrain.browser.graphs import export_gradient_graph
from crowdtrain.browser.report import SMALL_CONFIGS
from crowdtrain.browser.samples import batch_layout, synthetic_batch
from crowdtrain.campaigns.isolation import ISOLATION_HEADERS
from crowdtrain_agent.models import get_model
from crowdtrain_launcher import REPO_ROOT
from tests.browser.conftest import CHROMIUM

BUILD = REPO_ROOT / "frontend" / "static" / "build"
FAMILIES = ("mlp", "gpt", "resnet")
# A lease of two whole microbatches and one sample more: the last goes through the batch-1 graph.
WHOLE_MICROBATCHES = 2
WEBGPU_FLAGS = [
    "--no-sandbox",
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--enable-features=Vulkan",
]

PAGE = """<!doctype html><meta charset="utf-8"><title>tab gradients</title><script type="module">
const worker = new Worker("/build/tab-worker.js", {type: "module"});
const bytes = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());
const typed = (type, b) => type === "int64" ? new BigInt64Array(b.buffer) : new Float32Array(b.buffer);
window.gradient = async (family, webgpu) => {
  const spec = await (await fetch(`/${family}/spec.json`)).json();
  const params = new Float32Array((await bytes(`/${family}/params.bin`)).buffer);
  const x = {type: spec.x.type, data: typed(spec.x.type, await bytes(`/${family}/x.bin`)), dims: spec.x.dims};
  const y = {type: spec.y.type, data: typed(spec.y.type, await bytes(`/${family}/y.bin`)), dims: spec.y.dims};
  const answer = await new Promise((resolve) => {
    worker.onmessage = (event) => resolve(event.data);
    worker.postMessage({type: "gradient", graphUrl: `/${family}/graph.onnx`, singleUrl: `/${family}/single.onnx`,
      manifest: spec.manifest, params, x, y, ortUrl: new URL("/build/ort/", location.href).href, webgpu});
  });
  if (answer.error) return {error: answer.error};
  const raw = new Uint8Array(answer.grad.buffer);
  let text = "";
  for (let i = 0; i < raw.length; i += 0x8000) text += String.fromCharCode(...raw.subarray(i, i + 0x8000));
  return {lossSum: answer.lossSum, grad: btoa(text), runtime: answer.runtime, numSamples: answer.numSamples};
};
window.ready = true;
</script>"""


@pytest.fixture(autouse=True)
def live_site() -> None:
    """No site here (the conftest's autouse fixture starts one): these tests serve their own files."""


class _Isolated(http.server.SimpleHTTPRequestHandler):
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
        ".wasm": "application/wasm",
    }

    def end_headers(self) -> None:
        for name, value in ISOLATION_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _write_family(root: Path, family: str) -> dict[str, Any]:
    """Export the family's graphs, write them with random parameters and a batch; return what the check needs."""
    config, microbatch = SMALL_CONFIGS[family]
    entry = get_model(family)
    config = entry.validate(config)
    graph = export_gradient_graph(family, config, microbatch)
    single = export_gradient_graph(family, config, 1)
    n = WHOLE_MICROBATCHES * microbatch + 1
    x, y = synthetic_batch(batch_layout(family, config, n), seed=7)
    model = entry.build(config, seed=3).train()
    with torch.no_grad():  # random parameters, not the initial ones the gate checked
        gen = torch.Generator().manual_seed(11)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    here = root / family
    here.mkdir()
    (here / "graph.onnx").write_bytes(graph.onnx)
    (here / "single.onnx").write_bytes(single.onnx)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype("<f4")
    (here / "params.bin").write_bytes(flat.tobytes())
    kind = lambda t: "int64" if t.dtype == torch.int64 else "float32"  # noqa: E731
    (here / "x.bin").write_bytes(x.numpy().astype("<i8" if kind(x) == "int64" else "<f4").tobytes())
    (here / "y.bin").write_bytes(y.numpy().astype("<i8" if kind(y) == "int64" else "<f4").tobytes())
    spec = {
        "manifest": graph.manifest.to_dict(),
        "x": {"type": kind(x), "dims": list(x.shape)},
        "y": {"type": kind(y), "dims": list(y.shape)},
    }
    (here / "spec.json").write_text(json.dumps(spec))
    return {"model": model, "loss_sum": entry.loss_sum, "x": x, "y": y, "manifest": graph.manifest, "n": n}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, dict[str, Any]]]]:
    if not (BUILD / "tab-worker.js").is_file() or not (BUILD / "ort" / "ort.wasm.min.mjs").is_file():
        pytest.fail(f"the tab is not built: run `make charts` (npm run build in frontend/) first; {BUILD} lacks it")
    root = tmp_path_factory.mktemp("tab")
    (root / "build").symlink_to(BUILD)
    (root / "index.html").write_text(PAGE)
    families = {family: _write_family(root, family) for family in FAMILIES}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Isolated, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", families
    finally:
        server.shutdown()
        server.server_close()


def _tab_gradient(browser: Browser, url: str, family: str, webgpu: bool = False) -> dict[str, Any]:
    page = browser.new_page()
    try:
        page.goto(url)
        page.wait_for_function("window.ready === true")
        assert page.evaluate("crossOriginIsolated"), (
            "the page is served cross-origin isolated, as the site serves the tab"
        )
        return page.evaluate("([family, webgpu]) => window.gradient(family, webgpu)", [family, webgpu])
    finally:
        page.close()


def _check_within_the_gate(answer: dict[str, Any], case: dict[str, Any]) -> None:
    assert "error" not in answer, answer.get("error")
    assert answer["numSamples"] == case["n"]
    model, loss_sum, x, y = case["model"], case["loss_sum"], case["x"], case["y"]
    names = [spec.name for spec in case["manifest"].gradients]
    shapes = [tuple(spec.shape) for spec in case["manifest"].parameters]
    flat = np.frombuffer(base64.b64decode(answer["grad"]), dtype="<f4")
    grads, at = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        grads.append(flat[at : at + size].reshape(shape))
        at += size
    assert at == flat.size
    reference = fp64_gradients(model, loss_sum, x, y)
    params = list(model.parameters())
    with torch.enable_grad():
        loss = loss_sum(model, x, y)
        torch_grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    pytorch = deviation(names, (float(loss.detach().double()), [g.double().numpy() for g in torch_grads]), reference)
    tab = deviation(names, (float(answer["lossSum"]), grads), reference)
    limit = TOLERANCE * max(pytorch.relative, ERROR_FLOOR)
    name, runtime = case["manifest"].model_name, answer["runtime"]
    print(f"{name} {runtime}: tab {tab.relative:.2e} at {tab.worst}, torch fp32 {pytorch.relative:.2e}")
    assert tab.relative <= limit, (
        f"the tab's gradients differ from fp64 by {tab.relative:.2e} at {tab.worst} (max abs {tab.max_abs:.1e}); "
        f"PyTorch fp32's by {pytorch.relative:.2e}; the gate's bar is {limit:.1e}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tabs_gradient_matches_pytorch_within_the_gate(
    served: tuple[str, dict[str, dict[str, Any]]], browser: Browser, family: str
) -> None:
    url, families = served

    answer = _tab_gradient(browser, url, family)

    assert answer.get("runtime") == "wasm", answer
    _check_within_the_gate(answer, families[family])


def test_the_webgpu_path_matches_pytorch_on_chromiums_software_adapter(
    served: tuple[str, dict[str, dict[str, Any]]], playwright: Playwright
) -> None:
    url, families = served
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=WEBGPU_FLAGS)
    try:
        page = browser.new_page()
        page.goto(url)
        adapter = page.evaluate("async () => Boolean(navigator.gpu && await navigator.gpu.requestAdapter())")
        page.close()
        if not adapter:
            pytest.skip(
                f"this Chromium exposes no WebGPU adapter with {' '.join(WEBGPU_FLAGS)} (no software adapter here)"
            )
        answer = _tab_gradient(browser, url, "mlp", webgpu=True)
    finally:
        browser.close()

    assert answer.get("runtime") == "webgpu", answer
    _check_within_the_gate(answer, families["mlp"])

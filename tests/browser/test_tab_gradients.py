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
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Browser, Playwright

from crowdtrain.browser.report import SMALL_CONFIGS
from tests.browser.conftest import CHROMIUM
from tests.browser.tab_support import Family, export_family, gate_check, require_build, serving

FAMILIES = ("mlp", "gpt", "resnet")
SMALL_MICROBATCH = {name: SMALL_CONFIGS[name][1] for name in FAMILIES}
# A lease of two whole microbatches and one sample more: the last goes through the batch-1 graph.
WHOLE_MICROBATCHES = 2
# What onnxruntime-web's WebGPU provider cannot run, by family: the tab computes those on wasm instead.
WEBGPU_CANNOT = {"resnet": "The Indices output is not supported yet"}  # MaxPool's indices, for its backward
WEBGPU_FLAGS = [
    "--no-sandbox", "--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--enable-features=Vulkan",
]  # fmt: skip

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
  return {lossSum: answer.lossSum, grad: btoa(text), runtime: answer.runtime, fellBack: answer.fellBack,
    numSamples: answer.numSamples};
};
window.ready = true;
</script>"""


@pytest.fixture(autouse=True)
def live_site() -> None:
    """No site here (the conftest's autouse fixture starts one): these tests serve their own files."""


def _write(root: Path, family: Family) -> None:
    here = root / family.name
    here.mkdir()
    (here / "graph.onnx").write_bytes(family.graph.onnx)
    (here / "single.onnx").write_bytes(family.single.onnx)
    (here / "params.bin").write_bytes(family.flat_params().tobytes())
    kind = {True: "int64", False: "float32"}
    spec = {"manifest": family.manifest.to_dict()}
    for name, tensor in (("x", family.x), ("y", family.y)):
        integer = not tensor.is_floating_point()
        (here / f"{name}.bin").write_bytes(tensor.numpy().astype("<i8" if integer else "<f4").tobytes())
        spec[name] = {"type": kind[integer], "dims": list(tensor.shape)}
    (here / "spec.json").write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Family]]]:
    require_build()
    root = tmp_path_factory.mktemp("tab")
    (root / "index.html").write_text(PAGE)
    families = {}
    for name in FAMILIES:
        microbatch = SMALL_MICROBATCH[name]
        families[name] = export_family(name, WHOLE_MICROBATCHES * microbatch + 1)
        _write(root, families[name])
    with serving(root) as url:
        yield url, families


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


def _check_within_the_gate(answer: dict[str, Any], family: Family) -> None:
    assert "error" not in answer, answer.get("error")
    assert answer["numSamples"] == family.n
    flat = np.frombuffer(base64.b64decode(answer["grad"]), dtype="<f4")
    tab, pytorch, limit = gate_check(family, answer["lossSum"], flat)
    print(
        f"{family.name} {answer['runtime']}: tab {tab.relative:.2e} at {tab.worst}, torch fp32 {pytorch.relative:.2e}"
    )
    assert tab.relative <= limit, (
        f"the tab's gradients differ from fp64 by {tab.relative:.2e} at {tab.worst} (max abs {tab.max_abs:.1e}); "
        f"PyTorch fp32's by {pytorch.relative:.2e}; the gate's bar is {limit:.1e}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tabs_gradient_matches_pytorch_within_the_gate(
    served: tuple[str, dict[str, Family]], browser: Browser, family: str
) -> None:
    url, families = served

    answer = _tab_gradient(browser, url, family)

    assert answer.get("runtime") == "wasm", answer
    _check_within_the_gate(answer, families[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_webgpu_path_matches_pytorch_on_chromiums_software_adapter(
    served: tuple[str, dict[str, Family]], playwright: Playwright, family: str
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
        answer = _tab_gradient(browser, url, family, webgpu=True)
    finally:
        browser.close()

    if family in WEBGPU_CANNOT:
        assert answer.get("runtime") == "wasm" and WEBGPU_CANNOT[family] in answer.get("fellBack", ""), answer
    else:
        assert answer.get("runtime") == "webgpu" and not answer.get("fellBack"), answer
    _check_within_the_gate(answer, families[family])

"""A browser tab's speed on W1 against plain PyTorch on one thread, and what a first visit downloads (issue 36).

    python -m tests.benchmarks.browser_tab [--seconds 5]

Prints three ``bench:`` lines:

- ``browser_efficiency_w1``: the tab's samples/s on W1 (MLP 256-1024-1024-10, microbatch 64) computing a
  global batch's gradient with its own worker bundle in Debian's Chromium (onnxruntime-web, wasm, one
  thread), over plain PyTorch training on one thread (``baseline.measure``); target >= 0.22;
- ``browser_runtime_bytes``: the brotli bytes of the page's script, the worker and onnxruntime-web's wasm
  build, as the site sends them (the build writes the compressed copies);
- ``browser_webgpu_speedup``: skipped here, with the reason (WebGPU speed needs a real GPU; Chromium's
  software adapter is a CPU emulation, for correctness only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.benchmarks.baseline import W1, make_data, measure

CHROMIUM = Path("/usr/bin/chromium")
FIRST_VISIT = [
    "tab-page.js", "tab-worker.js", "ort/ort.wasm.min.mjs", "ort/ort-wasm-simd-threaded.mjs",
    "ort/ort-wasm-simd-threaded.wasm",
]  # fmt: skip

PAGE = """<!doctype html><meta charset="utf-8"><script type="module">
const worker = new Worker("/build/tab-worker.js", {type: "module"});
const bytes = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());
window.run = async (repeat) => {
  const spec = await (await fetch("/w1/spec.json")).json();
  const x = {type: "float32", data: new Float32Array((await bytes("/w1/x.bin")).buffer), dims: spec.x};
  const y = {type: "int64", data: new BigInt64Array((await bytes("/w1/y.bin")).buffer), dims: spec.y};
  const params = new Float32Array((await bytes("/w1/params.bin")).buffer);
  return new Promise((resolve) => {
    worker.onmessage = (event) => resolve({seconds: event.data.seconds, error: event.data.error});
    worker.postMessage({type: "gradient", graphUrl: "/w1/graph.onnx", manifest: spec.manifest, params, x, y,
      ortUrl: new URL("/build/ort/", location.href).href, repeat});
  });
};
window.ready = true;
</script>"""


def runtime_bytes(build: Path) -> tuple[int, int]:
    """(brotli, raw) bytes of a first visit's downloads."""
    brotli = sum((build / f"{name}.br").stat().st_size for name in FIRST_VISIT)
    raw = sum((build / name).stat().st_size for name in FIRST_VISIT)
    return brotli, raw


def tab_samples_per_s(seconds: float) -> float:
    """The tab's samples/s on W1's global batch, timed inside the worker after one warm-up run."""
    from playwright.sync_api import sync_playwright

    from crowdtrain.browser.graphs import export_gradient_graph
    from crowdtrain_agent.models import get_model
    from tests.browser.tab_support import serving

    graph = export_gradient_graph("mlp", W1.model_config, W1.microbatch)
    x, y = make_data(W1, W1.global_batch)
    model = get_model("mlp").build(W1.model_config, seed=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype("<f4")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "w1").mkdir()
        (root / "w1" / "graph.onnx").write_bytes(graph.onnx)
        (root / "w1" / "params.bin").write_bytes(flat.tobytes())
        (root / "w1" / "x.bin").write_bytes(x.astype("<f4").tobytes())
        (root / "w1" / "y.bin").write_bytes(y.astype("<i8").tobytes())
        spec = {"manifest": graph.manifest.to_dict(), "x": list(x.shape), "y": list(y.shape)}
        (root / "w1" / "spec.json").write_text(json.dumps(spec))
        (root / "index.html").write_text(PAGE)
        with serving(root) as url, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("window.ready === true")
            first = page.evaluate("(n) => window.run(n)", 1)  # warm-up: session creation, first run
            if first.get("error"):
                raise RuntimeError(f"the tab could not compute W1: {first['error']}")
            repeat = max(1, round(seconds / max(first["seconds"], 1e-3)))
            timed = page.evaluate("(n) => window.run(n)", repeat)
            browser.close()
    return W1.global_batch / float(timed["seconds"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each side is timed")
    args = parser.parse_args(argv)
    from crowdtrain_launcher import REPO_ROOT

    build = REPO_ROOT / "frontend" / "static" / "build"
    if not (build / "tab-worker.js").is_file():
        print("bench: browser_efficiency_w1=skipped (the tab is not built: run `make charts`)")
        print("bench: browser_runtime_bytes=skipped (the tab is not built: run `make charts`)")
        return 0
    brotli, raw = runtime_bytes(build)
    print(f"bench: browser_runtime_bytes={brotli} (brotli; {raw} raw: page, worker, onnxruntime-web wasm build)")
    if not CHROMIUM.is_file():
        print(f"bench: browser_efficiency_w1=skipped (no Chromium at {CHROMIUM}: `make chromium`)")
    else:
        tab = tab_samples_per_s(args.seconds)
        torch_speed = measure(W1, threads=1, seconds=args.seconds)
        print(
            f"bench: browser_efficiency_w1={tab / torch_speed:.3f} (tab {tab:.0f} samples/s, onnxruntime-web wasm "
            f"1 thread; PyTorch {torch_speed:.0f} samples/s, 1 thread; target >= 0.22)"
        )
    print(
        "bench: browser_webgpu_speedup=skipped (needs a real GPU; Chromium's software adapter here is a CPU "
        "emulation, checked for correctness only by tests/browser/test_tab_gradients.py)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

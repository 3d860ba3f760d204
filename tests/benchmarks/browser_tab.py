"""A browser tab on W1 against plain PyTorch on one thread, and what a first visit downloads (issue 36).

    python -m tests.benchmarks.browser_tab               # or: make bench
    python -m tests.benchmarks.browser_tab --steps 12 --warmup 2

Prints one ``bench: NAME=VALUE`` line per figure:

- ``browser_runtime_bytes``: the bytes a first visit to a campaign's tab page
  transfers until its first step commits (the page, its script, the worker,
  onnxruntime-web's wasm build, the gradient graphs, the first parameters and
  shards), as Chromium counts them; the note gives the runtime's own share
  (the brotli copies the build writes) and its raw size.
- ``browser_compute_w1``: the tab's gradient alone, W1's global batch
  computed by the worker's own bundle (onnxruntime-web, wasm, one thread),
  over plain PyTorch training on one thread: the most a tab can reach.
- ``browser_efficiency_w1``: committed samples/s of one tab training W1 alone
  through the site and an aggregator (Chromium on core 0; site and aggregator
  on core 1), over plain PyTorch with one thread on core 0, measured before
  and after the phase as in W1. The issue's target is 0.22.
- ``browser_webgpu_speedup``: a tab's W1 rate on WebGPU over wasm, where
  Chromium finds a hardware adapter; ``skipped`` with the reason elsewhere
  (Chromium's SwiftShader adapter is a CPU emulation: correctness only,
  ``tests/browser/test_tab_gradients.py``).

The site runs on the embedded SQLite default, as ``make demo`` does; the tab
is Debian's Chromium driven by Playwright, logged in as a volunteer who opens
the campaign's tab page, as a person would.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from .baseline import W1, make_data, measure, measure_in_process
from .figures import between_baselines, figure_line, ratio_or_unstable, skipped_line
from .w1 import REPO_ROOT, Swarm, _attempt_dir, _unstable_note, campaign_spec, get_json, steady_rate, write_npz

logger = logging.getLogger("tests.benchmarks.tab")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
EMAIL = "tab@bench.test"
PASSWORD = "bench tab password 41"
# Creates the tab's volunteer with a verified address (allauth's login wants one), as sign-up leaves them.
_MAKE_VOLUNTEER = """
from allauth.account.models import EmailAddress
from django.contrib.auth import get_user_model
user = get_user_model().objects.create_user(username="tab", email={email!r}, password={password!r})
EmailAddress.objects.create(user=user, email={email!r}, primary=True, verified=True)
"""


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


# What the tab's hello said computes in it, as My devices shows it.
_TAB_RUNTIME = """
from crowdtrain.accounts.models import Device
print(Device.objects.filter(owner__email={email!r}).values_list("hardware__runtime", flat=True).first())
"""


@dataclass(frozen=True)
class TabResult:
    samples_per_s: float
    first_visit: dict[str, int]  # bytes a first visit transferred until the first step, by kind (``_count``)
    runtime: str  # what the page said computes ("onnxruntime-web 1.30.0 wasm")


@contextmanager
def _pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """This process (and so the Chromium it starts) on ``cpus``; the site and aggregator keep the others."""
    own = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def run_tab_phase(
    run_dir: Path, npz: Path, *, steps: int, warmup: int, tab_cpus: Sequence[int] | None,
    server_cpus: Sequence[int] | None, webgpu: bool = False,
) -> TabResult:  # fmt: skip
    """A fresh site and aggregator training W1, and one tab as its only device; its steady rate."""
    from playwright.sync_api import sync_playwright

    env = {
        "CROWDTRAIN_VAR_DIR": str(run_dir / "var"),
        "CROWDTRAIN_TICKET_KEY": secrets.token_bytes(32).hex(),
        "CROWDTRAIN_DEBUG": "false",
    }
    with Swarm(run_dir, env=env) as swarm:
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(campaign_spec(npz, steps, 0, W1)))
        # seed_run starts the campaign, which would queue the graph's check to a thread that dies with it:
        # the check runs below instead, in the foreground, as a Celery worker would run it.
        seeding = swarm.manage(
            "seed_run", "--migrate", "--spec", str(spec_path), timeout_s=300, env={"CROWDTRAIN_BROWSER_GRAPHS": "false"}
        )
        seed = json.loads(seeding)
        campaign_id = seed["campaigns"][0]
        swarm.manage("shell", "-v", "0", "-c", _MAKE_VOLUNTEER.format(email=EMAIL, password=PASSWORD))
        logger.info(swarm.manage("check_browser_graphs", "--campaign", str(campaign_id), timeout_s=600).strip())
        site = swarm.start_site(cpus=server_cpus)
        aggregator = swarm.start_aggregator(site, token=seed["aggregators"]["agg-1"], name="agg-1", cpus=server_cpus)
        swarm.wait_until(lambda: get_json(f"{aggregator}/healthz")["slices"], 60, "the aggregator to hold its slice")
        progress_url = f"{site.url}/api/campaigns/{campaign_id}/progress"
        flags = [*CHROMIUM_FLAGS, *(["--enable-unsafe-webgpu"] if webgpu else ["--disable-gpu"])]
        with _pinned(tab_cpus), sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=flags)
            try:
                page = browser.new_page(base_url=site.url)
                page.goto("/accounts/login/")
                page.get_by_label("Email").fill(EMAIL)
                page.get_by_label("Password:", exact=True).fill(PASSWORD)
                page.get_by_role("button", name="Sign In").click()
                page.wait_for_url(lambda url: "/accounts/login/" not in url)
                transferred: dict[str, int] = {}
                page.on("requestfinished", lambda request: _count(transferred, request))
                page.on("worker", lambda worker: logger.info("tab worker started: %s", worker.url))
                page.goto(f"/campaigns/{campaign_id}/tab/" + ("?webgpu=1" if webgpu else ""))
                # Playwright's events arrive while it waits, not while this process sleeps.
                _wait(page, lambda: get_json(progress_url)["committed_steps"] >= 1, 300, "the tab's first step")
                first_visit = dict(transferred)
                _wait(page, lambda: get_json(progress_url)["version"] >= steps, 900, f"{steps} steps")
            finally:
                browser.close()
        dump = json.loads(swarm.manage("dump_run", "--campaign", str(campaign_id)))
        runtime = swarm.manage("shell", "-v", "0", "-c", _TAB_RUNTIME.format(email=EMAIL)).strip()
    return TabResult(steady_rate(dump["steps"][:steps], warmup), first_visit, runtime)


def _wait(page: Any, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``ready`` twice a second while the page works; the tab's problem line, if any, on a timeout."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            status = page.locator("#tab-status").inner_text()
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s; the tab says: {status}")
        page.wait_for_timeout(500)


def _count(transferred: dict[str, int], request: Any) -> None:
    """Add what a finished request cost the link (response headers and compressed body) to its kind's total.

    Kinds: ``runtime`` (the tab page and the site's static files: scripts, the worker, onnxruntime-web),
    ``graph``, ``parameters`` (from the aggregator), ``shards``, ``other`` (the API, the device's token).
    """
    sizes = request.sizes()
    size = int(sizes.get("responseHeadersSize", 0)) + int(sizes.get("responseBodySize", 0))
    path = urlsplit(request.url).path
    if path.startswith("/static/") or path.endswith("/tab/"):
        kind = "runtime"
    elif path.startswith("/browser/graphs/"):
        kind = "graph"
    elif path.startswith("/params/"):
        kind = "parameters"
    elif path.startswith("/api/shards/"):
        kind = "shards"
    else:
        kind = "other"
    transferred[kind] = transferred.get(kind, 0) + size


def webgpu_adapter() -> str:
    """The WebGPU adapter headless Chromium finds here, as a tab asks for it; "" for none.

    WebGPU exists only in a secure context, so the question is asked from a page
    on 127.0.0.1 (about:blank has no ``navigator.gpu``). A machine without a GPU
    answers only when a fallback adapter is allowed: Chromium's SwiftShader.
    """
    from playwright.sync_api import sync_playwright

    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            body = b"<!doctype html><title>webgpu</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blank) as server, sync_playwright() as playwright:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=[*CHROMIUM_FLAGS, "--enable-unsafe-webgpu"]
        )
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            return str(
                page.evaluate(
                    """async () => {
                        if (!navigator.gpu) return "";
                        const adapter = await navigator.gpu.requestAdapter()
                            || await navigator.gpu.requestAdapter({ forceFallbackAdapter: true });
                        if (!adapter) return "";
                        const info = adapter.info || {};
                        const words = [info.vendor, info.architecture, info.description];
                        if (info.isFallbackAdapter) words.push("software");
                        return words.filter(Boolean).join(" ") || "unknown";
                    }"""
                )
            )
        finally:
            browser.close()
            server.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="W1 steps the tab trains (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady rate (default 2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the compute phase and baselines run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of a phase whose baselines disagree")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "var" / "bench" / "tab")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    names = ("browser_runtime_bytes", "browser_compute_w1", "browser_efficiency_w1", "browser_webgpu_speedup")
    build = REPO_ROOT / "frontend" / "static" / "build"
    missing = "" if (build / "tab-worker.js").is_file() else "the tab is not built: run make charts"
    missing = missing or ("" if CHROMIUM.is_file() else f"no Chromium at {CHROMIUM}: run make chromium")
    if missing:
        for name in names:
            print(skipped_line(name, missing), flush=True)
        return 0

    tab = tab_samples_per_s(args.seconds)
    torch_speed = measure(W1, threads=1, seconds=args.seconds)
    note = f"the gradient alone: tab {tab:.0f} samples/s, PyTorch training {torch_speed:.0f}, one thread each"
    print(figure_line("browser_compute_w1", tab / torch_speed, note), flush=True)

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    npz = args.out / "w1.npz"
    write_npz(npz)
    two_cores = len(os.sched_getaffinity(0)) >= 2
    tab_cpus, server_cpus = ([0], [1]) if two_cores else (None, None)
    results: list[TabResult] = []

    def baseline() -> float:
        return measure_in_process(threads=1, cpus=tab_cpus, seconds=args.seconds)

    def phase(attempt: int) -> float:
        result = run_tab_phase(
            _attempt_dir(args.out / "wasm", attempt), npz, steps=args.steps, warmup=args.warmup,
            tab_cpus=tab_cpus, server_cpus=server_cpus,
        )  # fmt: skip
        results.append(result)
        return result.samples_per_s

    rate, pair = between_baselines("tab", phase, baseline, repeats=args.repeats)
    brotli, raw = runtime_bytes(build)
    visit = results[-1].first_visit
    rest = ", ".join(f"{kind} {size}" for kind, size in sorted(visit.items()) if kind != "runtime")
    note = f"page, scripts, worker, onnxruntime-web; the build's brotli copies {brotli}, raw {raw}; then {rest}"
    print(figure_line("browser_runtime_bytes", visit.get("runtime", 0), note), flush=True)
    note = f"tab {rate:.0f} samples/s ({results[-1].runtime}), plain PyTorch {pair.best:.0f}; target 0.22"
    print(ratio_or_unstable("browser_efficiency_w1", rate, pair) + f" ({note}{_unstable_note(pair)})", flush=True)
    adapter = webgpu_adapter()
    if not adapter:
        print(skipped_line("browser_webgpu_speedup", "Chromium finds no WebGPU adapter on this machine"))
    elif "software" in adapter.lower() or "swiftshader" in adapter.lower():
        print(skipped_line("browser_webgpu_speedup", f"only a software adapter ({adapter}): no GPU to measure"))
    else:
        gpu = run_tab_phase(
            args.out / "webgpu", npz, steps=args.steps, warmup=args.warmup, tab_cpus=tab_cpus,
            server_cpus=server_cpus, webgpu=True,
        )  # fmt: skip
        print(figure_line("browser_webgpu_speedup", gpu.samples_per_s / rate, f"adapter {adapter}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

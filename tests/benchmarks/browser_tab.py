"""A browser tab on W1 against plain PyTorch on one thread, and what a first visit downloads (issue 36).

    python -m tests.benchmarks.browser_tab               # or: make bench
    python -m tests.benchmarks.browser_tab --steps 16 --warmup 2

Prints one ``bench: NAME=VALUE`` line per figure:

- ``browser_runtime_bytes``: the bytes a first visit to a campaign's tab page
  transfers until its first step commits (the page, its script, the worker,
  onnxruntime-web's wasm build, the gradient graphs, the first parameters and
  shards), as Chromium counts them; the note gives the runtime's own share
  (the brotli copies the build writes) and its raw size.
- ``browser_compute_w1``: the tab's gradient alone, W1's global batch
  computed by the worker's own bundle (onnxruntime-web, wasm, one thread;
  through the wide graph, as a lease is) over plain PyTorch training on one
  thread: the most a tab can reach. Each has core 0 to itself (all of
  Chromium's processes for the tab).
- ``browser_efficiency_w1``: committed samples/s of one tab training W1 alone
  through the site and an aggregator (Chromium alone on core 0; site,
  aggregator and this harness on core 1), over plain PyTorch with one thread
  on core 0, measured before and after the phase as in W1. Only the steps
  after the harness let go of Chromium are timed: a volunteer's browser has no
  DevTools attached. The issue's target is 0.22. These are the conditions of
  the agent's own W1 figure: the device alone on core 0.
- ``browser_efficiency_w1_both_cores``: the same with Chromium free on both
  cores, beside the site and aggregator on core 1: a volunteer's browser
  shares its machine with whatever else runs there.
- ``browser_webgpu_speedup``: a tab's W1 rate on WebGPU over wasm, where
  Chromium finds a hardware adapter; ``skipped`` with the reason elsewhere
  (Chromium's SwiftShader adapter is a CPU emulation: correctness only,
  ``tests/browser/test_tab_gradients.py``).

The site runs on the embedded SQLite default, as ``make demo`` does; the tab
is Debian's Chromium, started here and driven by Playwright over DevTools,
logged in as a volunteer who opens the campaign's tab page, as a person would.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import logging
import os
import secrets
import shutil
import subprocess
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

from .baseline import W1, make_data, measure_in_process
from .figures import between_baselines, figure_line, ratio_or_unstable, skipped_line
from .w1 import REPO_ROOT, Swarm, _attempt_dir, _unstable_note, campaign_spec, get_json, steady_rate, write_npz

logger = logging.getLogger("tests.benchmarks.tab")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
# A Chromium just started that has not answered Playwright's attach in this long never does: about one
# start in six here hung so (its DevTools socket open, no reply); a fresh one is started instead.
CONNECT_TIMEOUT_MS = 30_000
CONNECT_ATTEMPTS = 3
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
    worker.postMessage({type: "gradient", graphUrl: "/w1/graph.onnx", wideUrl: spec.wide ? "/w1/wide.onnx" : null,
      wideBatch: spec.wide, manifest: spec.manifest, params, x, y, ortUrl: new URL("/build/ort/", location.href).href,
      repeat});
  });
};
window.ready = true;
</script>"""


def runtime_bytes(build: Path) -> tuple[int, int]:
    """(brotli, raw) bytes of a first visit's downloads."""
    brotli = sum((build / f"{name}.br").stat().st_size for name in FIRST_VISIT)
    raw = sum((build / name).stat().st_size for name in FIRST_VISIT)
    return brotli, raw


def tab_samples_per_s(
    seconds: float, work_dir: Path, *, tab_cpus: Sequence[int] | None, harness_cpus: Sequence[int] | None
) -> float:
    """The tab's samples/s on W1's global batch, timed inside the worker after one warm-up run.

    Chromium runs on ``tab_cpus`` as in the end-to-end phase, the harness beside the servers.
    """
    from playwright.sync_api import sync_playwright

    from crowdtrain.browser.graphs import export_gradient_graph
    from crowdtrain_agent.models import get_model
    from tests.browser.tab_support import serving

    graph = export_gradient_graph("mlp", W1.model_config, W1.microbatch)
    # The wide graph the site offers W1 (its samples do not meet in a batch), as a lease would run it.
    wide = W1.microbatch * int(os.environ.get("CROWDTRAIN_BROWSER_WIDE_MICROBATCHES", "4"))
    wide_graph = export_gradient_graph("mlp", W1.model_config, wide) if wide > W1.microbatch else None
    x, y = make_data(W1, W1.global_batch)
    model = get_model("mlp").build(W1.model_config, seed=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype("<f4")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "w1").mkdir()
        (root / "w1" / "graph.onnx").write_bytes(graph.onnx)
        if wide_graph is not None:
            (root / "w1" / "wide.onnx").write_bytes(wide_graph.onnx)
        (root / "w1" / "params.bin").write_bytes(flat.tobytes())
        (root / "w1" / "x.bin").write_bytes(x.astype("<f4").tobytes())
        (root / "w1" / "y.bin").write_bytes(y.astype("<i8").tobytes())
        spec = {"manifest": graph.manifest.to_dict(), "x": list(x.shape), "y": list(y.shape)}
        spec["wide"] = wide if wide_graph is not None else 0
        (root / "w1" / "spec.json").write_text(json.dumps(spec))
        (root / "index.html").write_text(PAGE)
        with (
            serving(root) as url,
            _pinned(harness_cpus),
            sync_playwright() as playwright,
            attached_chromium(playwright, work_dir / "chromium", cpus=tab_cpus, flags=CHROMIUM_FLAGS) as browser,
        ):
            page = browser.contexts[0].new_page()
            page.goto(url)
            page.wait_for_function("window.ready === true")
            first = page.evaluate("(n) => window.run(n)", 1)  # warm-up: session creation, first run
            if first.get("error"):
                raise RuntimeError(f"the tab could not compute W1: {first['error']}")
            # Two seconds more of warm-up: V8 moves onnxruntime's hot wasm functions to its optimizing tier in
            # the background, which on one core was still going on after the first run.
            page.evaluate("(n) => window.run(n)", max(1, round(2.0 / max(first["seconds"], 1e-3))))
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
    """This process (the harness, and the Playwright driver it starts) on ``cpus``, off the tab's core."""
    own = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


@contextmanager
def own_chromium(profile: Path, *, cpus: Sequence[int] | None, flags: Sequence[str]) -> Iterator[str]:
    """A headless Chromium of its own on ``cpus``; yields its DevTools endpoint for ``connect_over_cdp``.

    Started here rather than by Playwright's launch so that the harness can let go of it: while
    Playwright is attached, Chromium copies every WebSocket frame (base64) and every response to the
    driver, which cost the tab ~0.3 s per W1 step on its one core, and a volunteer's browser has no
    DevTools attached. Chromium alone gets ``cpus``, as the agent alone gets its core in W1.
    """
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "DevToolsActivePort").unlink(missing_ok=True)
    command = [str(CHROMIUM), "--headless", "--remote-debugging-port=0", f"--user-data-dir={profile}", *flags]
    if cpus:
        command = ["taskset", "-c", ",".join(str(c) for c in cpus), *command]
    # Chromium's own lines beside the profile, for a run that went wrong.
    with profile.with_suffix(".log").open("wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            port_file = profile / "DevToolsActivePort"
            while not (port_file.is_file() and port_file.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Chromium at {CHROMIUM} did not open its DevTools port (exit {process.poll()})")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port_file.read_text().split()[0]}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def attached_chromium(
    playwright: Any, profile: Path, *, cpus: Sequence[int] | None, flags: Sequence[str]
) -> Iterator[Any]:
    """``own_chromium`` with Playwright attached over DevTools; started afresh when an attach hangs.

    Chromium runs until the block ends, whether or not the harness let go of it before (``browser.close()``).
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(CONNECT_ATTEMPTS):
        where = profile if attempt == 0 else profile.with_name(f"{profile.name}-{attempt}")
        with own_chromium(where, cpus=cpus, flags=flags) as endpoint:
            try:
                browser = playwright.chromium.connect_over_cdp(endpoint, timeout=CONNECT_TIMEOUT_MS)
            except PlaywrightTimeout:
                logger.warning("Chromium (%s) did not answer the attach in %d s; starting another", where,
                               CONNECT_TIMEOUT_MS // 1000)  # fmt: skip
                continue
            yield browser
            return
    raise RuntimeError(f"{CONNECT_ATTEMPTS} Chromiums in a row did not answer Playwright's attach; see {profile}*.log")


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
        with (
            _pinned(server_cpus),
            sync_playwright() as playwright,
            attached_chromium(playwright, run_dir / "chromium", cpus=tab_cpus, flags=flags) as browser,
        ):
            # A page of the default context outlives the harness's connection (a new context would not).
            page = browser.contexts[0].new_page()
            page.goto(f"{site.url}/accounts/login/")
            page.get_by_label("Email").fill(EMAIL)
            page.get_by_label("Password:", exact=True).fill(PASSWORD)
            page.get_by_role("button", name="Sign In").click()
            page.wait_for_url(lambda url: "/accounts/login/" not in url)
            transferred: dict[str, int] = {}
            page.on("requestfinished", lambda request: _count(transferred, request))
            page.on("worker", lambda worker: logger.info("tab worker started: %s", worker.url))
            page.goto(f"{site.url}/campaigns/{campaign_id}/tab/" + ("?webgpu=1" if webgpu else ""))
            # Playwright's events arrive while it waits, not while this process sleeps.
            _wait(page, lambda: get_json(progress_url)["committed_steps"] >= 1, 300, "the tab's first step")
            first_visit = dict(transferred)
            let_go = int(get_json(progress_url)["version"])
            browser.close()  # lets go of Chromium: the tab trains on, with no DevTools attached
            _poll(lambda: get_json(progress_url)["version"] >= steps, 900, f"{steps} steps")
        dump = json.loads(swarm.manage("dump_run", "--campaign", str(campaign_id)))
        runtime = swarm.manage("shell", "-v", "0", "-c", _TAB_RUNTIME.format(email=EMAIL)).strip()
    # The steps timed are those after the harness let go, and after the warm-up asked for.
    return TabResult(steady_rate(dump["steps"][:steps], max(warmup, let_go)), first_visit, runtime)


def _wait(page: Any, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``ready`` twice a second while the page works; the tab's problem line, if any, on a timeout."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            status = page.locator("#tab-status").inner_text()
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s; the tab says: {status}")
        page.wait_for_timeout(500)


def _poll(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``ready`` twice a second, with no page to ask why on a timeout (the harness let go of it)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s; see the site's log for the tab's device")
        time.sleep(0.5)


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


def _phase(
    attempt: int, *, out: Path, npz: Path, steps: int, warmup: int, tab_cpus: Sequence[int] | None,
    server_cpus: Sequence[int] | None, results: list[TabResult],
) -> float:  # fmt: skip
    """One attempt of a placement's end-to-end phase; its result kept in ``results``, its rate returned."""
    result = run_tab_phase(
        _attempt_dir(out, attempt), npz, steps=steps, warmup=warmup, tab_cpus=tab_cpus, server_cpus=server_cpus
    )
    results.append(result)
    return result.samples_per_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="W1 steps the tab trains (default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady rate (default 2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the compute phase and baselines run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of a phase whose baselines disagree")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "var" / "bench" / "tab")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    names = (
        "browser_runtime_bytes", "browser_compute_w1", "browser_efficiency_w1", "browser_efficiency_w1_both_cores",
        "browser_webgpu_speedup",
    )  # fmt: skip
    build = REPO_ROOT / "frontend" / "static" / "build"
    missing = "" if (build / "tab-worker.js").is_file() else "the tab is not built: run make charts"
    missing = missing or ("" if CHROMIUM.is_file() else f"no Chromium at {CHROMIUM}: run make chromium")
    if missing:
        for name in names:
            print(skipped_line(name, missing), flush=True)
        return 0

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    two_cores = len(os.sched_getaffinity(0)) >= 2
    torch_cpus, server_cpus = ([0], [1]) if two_cores else (None, None)
    # Where Chromium runs: all of it on core 0 alone, as the agent alone has core 0 in W1 and PyTorch has it
    # here; then free on both cores, where its threads meet the site's and the aggregator's on core 1.
    placements = [("", torch_cpus), ("_both_cores", None)] if two_cores else [("", None)]
    torch_speed = measure_in_process(threads=1, cpus=torch_cpus, seconds=args.seconds)
    computes = {
        suffix: tab_samples_per_s(args.seconds, args.out / f"compute{suffix}", tab_cpus=cpus, harness_cpus=server_cpus)
        for suffix, cpus in placements
    }
    both = computes.get("_both_cores")
    both_note = f"; Chromium free on both cores: {both / torch_speed:.3f}" if both else ""
    note = f"the gradient alone: tab {computes['']:.0f} samples/s, PyTorch training {torch_speed:.0f}, one thread each"
    print(figure_line("browser_compute_w1", computes[""] / torch_speed, note + both_note), flush=True)

    npz = args.out / "w1.npz"
    write_npz(npz)
    rate = 0.0
    for suffix, tab_cpus in placements:
        results: list[TabResult] = []

        phase = functools.partial(
            _phase, out=args.out / f"wasm{suffix}", npz=npz, steps=args.steps, warmup=args.warmup,
            tab_cpus=tab_cpus, server_cpus=server_cpus, results=results,
        )  # fmt: skip
        baseline = functools.partial(measure_in_process, threads=1, cpus=torch_cpus, seconds=args.seconds)
        tab_rate, pair = between_baselines(f"tab{suffix}", phase, baseline, repeats=args.repeats)
        if not suffix:
            rate = tab_rate
            brotli, raw = runtime_bytes(build)
            visit = results[-1].first_visit
            rest = ", ".join(f"{kind} {size}" for kind, size in sorted(visit.items()) if kind != "runtime")
            note = f"page, scripts, worker, onnxruntime-web; the build's brotli copies {brotli}, raw {raw}; then {rest}"
            print(figure_line("browser_runtime_bytes", visit.get("runtime", 0), note), flush=True)
        where = "all of Chromium on core 0 alone, as the agent in W1" if tab_cpus else "Chromium free on both cores"
        note = f"tab {tab_rate:.0f} samples/s ({results[-1].runtime}; {where}), plain PyTorch {pair.best:.0f}"
        line = ratio_or_unstable(f"browser_efficiency_w1{suffix}", tab_rate, pair)
        print(f"{line} ({note}; target 0.22{_unstable_note(pair)})", flush=True)
    adapter = webgpu_adapter()
    if not adapter:
        print(skipped_line("browser_webgpu_speedup", "Chromium finds no WebGPU adapter on this machine"))
    elif "software" in adapter.lower() or "swiftshader" in adapter.lower():
        print(skipped_line("browser_webgpu_speedup", f"only a software adapter ({adapter}): no GPU to measure"))
    else:
        gpu = run_tab_phase(
            args.out / "webgpu", npz, steps=args.steps, warmup=args.warmup, tab_cpus=None,
            server_cpus=server_cpus, webgpu=True,
        )  # fmt: skip
        print(figure_line("browser_webgpu_speedup", gpu.samples_per_s / rate, f"adapter {adapter}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the browser tab's tests share: graphs exported as the site exports them, a cross-origin isolated file
server, and the gate's measure of a tab's gradient against PyTorch."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crowdtrain.browser.gate import ERROR_FLOOR, TOLERANCE, Deviation, deviation, fp64_gradients
from crowdtrain.browser.graphs import GradientGraph, GraphManifest, export_gradient_graph
from crowdtrain.browser.report import SMALL_CONFIGS
from crowdtrain.campaigns.isolation import ISOLATION_HEADERS
from crowdtrain_agent.models import get_model
from crowdtrain_launcher import REPO_ROOT

BUILD = REPO_ROOT / "frontend" / "static" / "build"


def require_build() -> None:
    """Fail with what to do when the tab's bundles are not built."""
    if not (BUILD / "tab-worker.js").is_file() or not (BUILD / "ort" / "ort.wasm.min.mjs").is_file():
        raise AssertionError(
            f"the tab is not built: run `make charts` (npm run build in frontend/) first; {BUILD} lacks it"
        )


@dataclass
class Family:
    """A registry family's graphs, a model with random parameters and a batch of ``n`` samples."""

    name: str
    config: dict[str, Any]
    microbatch: int
    graph: GradientGraph
    single: GradientGraph
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor

    @property
    def manifest(self) -> GraphManifest:
        return self.graph.manifest

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def flat_params(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).numpy().astype("<f4")


def export_family(name: str, samples: int, *, seed: int = 3) -> Family:
    """The family's small config (crowdtrain.browser.report) exported for its microbatch and for one sample."""
    from crowdtrain.browser.samples import batch_layout, synthetic_batch

    config, microbatch = SMALL_CONFIGS[name]
    entry = get_model(name)
    config = entry.validate(config)
    graph = export_gradient_graph(name, config, microbatch)
    single = export_gradient_graph(name, config, 1)
    x, y = synthetic_batch(batch_layout(name, config, samples), seed=seed + 4)
    model = entry.build(config, seed=seed).train()
    with torch.no_grad():  # random parameters, not the initial ones the gate checked
        gen = torch.Generator().manual_seed(seed + 8)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return Family(name, config, microbatch, graph, single, model, x, y)


def gate_check(family: Family, loss_sum: float, flat_grad: np.ndarray, x: torch.Tensor | None = None,
               y: torch.Tensor | None = None) -> tuple[Deviation, Deviation, float]:  # fmt: skip
    """The tab's and PyTorch fp32's errors against fp64 (the gate's measure), and the gate's bar."""
    x = family.x if x is None else x
    y = family.y if y is None else y
    loss_fn = get_model(family.name).loss_sum
    names = [spec.name for spec in family.manifest.gradients]
    grads, at = [], 0
    for spec in family.manifest.parameters:
        size = int(np.prod(spec.shape))
        grads.append(flat_grad[at : at + size].reshape(spec.shape))
        at += size
    assert at == flat_grad.size, f"the tab's gradient has {flat_grad.size} values, the model {at}"
    reference = fp64_gradients(family.model, loss_fn, x, y)
    params = list(family.model.parameters())
    with torch.enable_grad():
        loss = loss_fn(family.model, x, y)
        torch_grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    pytorch = deviation(names, (float(loss.detach().double()), [g.double().numpy() for g in torch_grads]), reference)
    tab = deviation(names, (float(loss_sum), grads), reference)
    return tab, pytorch, TOLERANCE * max(pytorch.relative, ERROR_FLOOR)


class IsolatedFiles(http.server.SimpleHTTPRequestHandler):
    """Static files with the headers the site sends the tab's page, worker and ort files."""

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


@contextmanager
def serving(root: Path, handler: type[IsolatedFiles] = IsolatedFiles) -> Iterator[str]:
    """Serve ``root`` (with ``build/`` linked to the tab's build) on a free port; yields the base URL."""
    if not (root / "build").exists():
        (root / "build").symlink_to(BUILD)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()

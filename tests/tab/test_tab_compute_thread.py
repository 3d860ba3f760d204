"""The tab's compute worker (frontend/src/tab/compute_thread.js) under Node with onnxruntime-web's own wasm.

The loop's side of the call protocol is tested with a fake worker (steps.test.mjs); this is the other side,
on real graphs exported here: a lease's gradient is the agent's, a lease given back while it waits in the
queue never starts, and a graph the loop told it to forget is gone while one sent again is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from crowdtrain.browser.graphs import export_gradient_graph
from crowdtrain.browser.samples import batch_layout, synthetic_batch
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import ModelSpec
from crowdtrain_agent.trainer import ModelCache, compute_gradient, load_params_

REPO = Path(__file__).resolve().parents[2]
TEST = REPO / "tests" / "tab" / "compute_thread.test.mjs"
ORT = REPO / "frontend" / "node_modules" / "onnxruntime-web" / "dist"
CONFIG = {"in_dim": 6, "hidden": [8], "classes": 3}
MICROBATCH = 4
WIDE = 16  # four microbatches a run
SAMPLES = 41  # two wide runs, two microbatches and one sample for the batch-1 graph


def test_the_compute_worker_computes_the_agents_gradient_and_keeps_its_queue_in_order(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: the tab's modules are tested under Node 20 (apt-get install nodejs npm)")
    if not (ORT / "ort.wasm.min.mjs").is_file():
        pytest.fail("frontend/node_modules/onnxruntime-web is missing: run `make charts` (npm ci in frontend/) first")
    main = export_gradient_graph("mlp", CONFIG, MICROBATCH)
    single = export_gradient_graph("mlp", CONFIG, 1)
    wide = export_gradient_graph("mlp", CONFIG, WIDE)
    x, y = synthetic_batch(batch_layout("mlp", CONFIG, SAMPLES), seed=7)
    model = get_model("mlp").build(CONFIG, seed=2)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    cm = ModelCache(torch.device("cpu")).get(1, ModelSpec(architecture="mlp", config=CONFIG))
    load_params_(cm, flat, version=1)
    agent = compute_gradient(cm, x, y, microbatch_size=MICROBATCH)

    (tmp_path / "main.onnx").write_bytes(main.onnx)
    (tmp_path / "single.onnx").write_bytes(single.onnx)
    (tmp_path / "wide.onnx").write_bytes(wide.onnx)
    flat.numpy().astype("<f4").tofile(tmp_path / "params.bin")
    x.numpy().astype("<f4").tofile(tmp_path / "x.bin")
    y.numpy().astype("<i8").tofile(tmp_path / "y.bin")
    spec = {
        "ort": f"{ORT}/",
        "main": main.sha256,
        "single": single.sha256,
        "wide": wide.sha256,
        "wideBatch": WIDE,
        "manifest": main.manifest.to_dict(),
        "x": list(x.shape),
        "y": list(y.shape),
        "loss": float(agent.loss_sum),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    agent.grad.numpy().astype("<f4").tofile(tmp_path / "expected.bin")

    done = subprocess.run(
        [node, "--test", str(TEST)], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "CROWDTRAIN_TAB_CASE": str(tmp_path)},
    )  # fmt: skip

    assert done.returncode == 0, f"node --test {TEST.name} failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert "# fail 0" in done.stdout and "# pass 0" not in done.stdout

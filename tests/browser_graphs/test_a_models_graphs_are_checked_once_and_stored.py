"""A model's browser graphs are exported and gated once per (model, config, microbatch), stored by their sha256."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.files.storage import default_storage
from django.test import override_settings
from django.utils import timezone

from crowdtrain.browser import checking, gate
from crowdtrain.browser.gate import GateResult, check_browser_compute
from crowdtrain.browser.graphs import GradientGraph
from crowdtrain.browser.memory import graph_memory, memory_bytes
from crowdtrain.browser.models import BrowserGraph, graph_storage_name

pytestmark = pytest.mark.django_db

MLP = {"in_dim": 4, "hidden": [8], "classes": 3}
Checked = dict[int, tuple[GradientGraph | None, GateResult]]


@pytest.fixture(scope="module")
def exported() -> Checked:
    """The real export and gate of a tiny MLP, for microbatches of 2 and 1: done once for the module."""
    return {size: check_browser_compute("mlp", MLP, size) for size in (2, 1)}


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=True):
        yield


def replaying(exported: Checked, **changes: Callable[[Any], Any]) -> Callable[..., Any]:
    """``check_browser_compute`` answering with the module's export; ``changes`` edit the verdict of a size."""

    def check(model_name: str, model_config: Any, size: int) -> tuple[GradientGraph | None, GateResult]:
        graph, verdict = exported[size]
        change = changes.get(f"size_{size}")
        return (graph, change(verdict)) if change else (graph, verdict)

    return check


def test_both_graphs_pass_and_are_stored_by_their_sha256(exported: Checked, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported))
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "passed"
    big, one = exported[2][0], exported[1][0]
    assert big is not None and one is not None
    assert (checked.sha256, checked.sha256_one) == (big.sha256, one.sha256)
    assert (checked.bytes, checked.bytes_one) == (len(big.onnx), len(one.onnx))
    with default_storage.open(graph_storage_name(big.sha256), "rb") as fh:
        assert fh.read() == big.onnx
    assert default_storage.exists(graph_storage_name(one.sha256))
    assert checked.manifest["microbatch_size"] == 2
    assert checked.ratio is not None and 0 < checked.ratio <= 10
    assert checked.graph_error is not None and checked.torch_error is not None
    assert "match PyTorch's" in checked.reason and checked.checked_at is not None


def test_a_wide_graph_passes_against_the_sum_of_its_microbatches_and_is_stored(
    exported: Checked, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported))
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    with override_settings(CROWDTRAIN_BROWSER_WIDE_MICROBATCHES=4):
        checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "passed" and checked.wide_size == 8
    with default_storage.open(graph_storage_name(checked.sha256_wide), "rb") as fh:
        wide = fh.read()
    assert len(wide) == checked.bytes_wide
    big, one = exported[2][0], exported[1][0]
    assert big is not None and one is not None
    assert checked.memory_bytes == memory_bytes(big.onnx, one.onnx, wide) > memory_bytes(big.onnx, one.onnx)


@pytest.mark.parametrize("why", ["off", "its gate fails"])
def test_no_wide_graph_when_off_or_when_it_is_not_the_sum_and_the_row_still_passes(
    why: str, exported: Checked, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported))
    wide_checks: list[int] = []

    def failing(model_name: str, model_config: Any, microbatch_size: int, microbatches: int) -> Any:
        wide_checks.append(microbatches)
        graph, verdict = exported[2]
        return graph, dataclasses.replace(verdict, passed=False, reason="cnn: gradients differ")

    monkeypatch.setattr(gate, "check_wide", failing)
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    with override_settings(CROWDTRAIN_BROWSER_WIDE_MICROBATCHES=1 if why == "off" else 4):
        checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "passed"
    assert (checked.wide_size, checked.sha256_wide, checked.bytes_wide) == (0, "", 0)
    assert wide_checks == ([] if why == "off" else [4])
    big, one = exported[2][0], exported[1][0]
    assert big is not None and one is not None
    assert checked.memory_bytes == memory_bytes(big.onnx, one.onnx)


def test_the_memory_estimate_holds_parameters_gradients_their_sum_and_activations(exported: Checked) -> None:
    big, one = exported[2][0], exported[1][0]
    assert big is not None and one is not None
    params = sum(4 * math.prod(spec.shape) for spec in big.manifest.parameters)

    total = memory_bytes(big.onnx, one.onnx)

    inputs, outputs, intermediates = graph_memory(big.onnx)
    assert outputs >= params and inputs >= params  # every gradient and every parameter, in fp32
    assert intermediates > 0  # shape inference found the activations
    assert total == len(big.onnx) + inputs + 2 * outputs + intermediates + len(one.onnx) + graph_memory(one.onnx)[2]
    assert total >= 3 * params


def test_one_row_and_one_export_for_two_campaigns_with_the_same_model(
    exported: Checked, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted(model_name: str, model_config: Any, size: int) -> Any:
        calls.append(size)
        return exported[size]

    monkeypatch.setattr(gate, "check_browser_compute", counted)
    first = checking.request_check("mlp", {"classes": 3, "hidden": [8], "in_dim": 4}, 2, queue=False)
    second = checking.request_check("mlp", MLP, 2, queue=False)  # the same config, keys in another order
    assert first is not None and second is not None

    checking.run_check(first.pk)
    again = checking.run_check(second.pk)

    assert first.pk == second.pk and BrowserGraph.objects.count() == 1
    assert again is None and calls == [2, 1]


def test_only_one_worker_takes_a_pending_row_until_it_is_stale() -> None:
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    first, second = checking.claim(row.pk), checking.claim(row.pk)
    BrowserGraph.objects.filter(pk=row.pk).update(started_at=timezone.now() - timedelta(hours=1))
    third = checking.claim(row.pk)

    assert first is not None and second is None
    assert third is not None and third > first


def test_a_worker_overtaken_on_a_stale_row_does_not_overwrite_its_successor(
    exported: Checked, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    def overtaken(model_name: str, model_config: Any, size: int) -> Any:
        BrowserGraph.objects.filter(pk=row.pk).update(started_at=timezone.now() + timedelta(seconds=1))
        return exported[size]

    monkeypatch.setattr(gate, "check_browser_compute", overtaken)

    assert checking.run_check(row.pk) is None
    assert BrowserGraph.objects.get(pk=row.pk).status == "pending"


def test_a_single_sample_graph_that_fails_the_gate_refuses_the_model(
    exported: Checked, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = lambda v: dataclasses.replace(v, passed=False, ratio=50.0, reason="mlp: gradients differ")  # noqa: E731
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported, size_1=failed))
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "refused"
    assert (
        checked.reason == "mlp: gradients differ (the graph for a single sample, which a lease's last microbatch needs)"
    )
    assert checked.ratio == 50.0 and checked.sha256 == ""


def test_a_model_that_cannot_be_exported_is_refused_with_the_reason() -> None:
    row = checking.request_check("mlp", {"in_dim": 4, "hidden": [8], "classes": 3, "wings": 2}, 2, queue=False)
    assert row is not None

    checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "refused"
    assert "wings" in checked.reason and checked.ratio is None


def test_an_unexpected_error_is_a_refusal_that_asks_to_be_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise MemoryError("out of memory in the exporter")

    monkeypatch.setattr(gate, "check_browser_compute", broken)
    row = checking.request_check("mlp", MLP, 2, queue=False)
    assert row is not None

    with caplog.at_level(logging.ERROR, logger="crowdtrain.browser.checking"):
        checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "refused"
    assert "MemoryError: out of memory in the exporter" in checked.reason and "report" in checked.reason
    assert any(record.exc_info for record in caplog.records)


def test_a_microbatch_of_one_needs_no_second_graph(exported: Checked, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported))
    row = checking.request_check("mlp", MLP, 1, queue=False)
    assert row is not None

    checked = checking.run_check(row.pk)

    assert checked is not None and checked.status == "passed"
    assert checked.sha256_one == "" and checked.bytes_one == 0


def test_again_checks_a_decided_row_once_more(exported: Checked, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "check_browser_compute", replaying(exported))
    row = checking.request_check("mlp", MLP, 1, queue=False)
    assert row is not None
    checking.run_check(row.pk)

    checking.request_check("mlp", MLP, 1, again=True, queue=False)
    rechecked = checking.run_check(row.pk)

    assert rechecked is not None and rechecked.status == "passed"


def test_with_browser_graphs_off_nothing_is_created_and_the_verdict_says_so() -> None:
    with override_settings(CROWDTRAIN_BROWSER_GRAPHS=False):
        row = checking.request_check("mlp", MLP, 2)
        verdict = checking.verdict_for("mlp", MLP, 2)

    assert row is None and not BrowserGraph.objects.exists()
    assert verdict.status == "refused" and "CROWDTRAIN_BROWSER_GRAPHS" in verdict.reason

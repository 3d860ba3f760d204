"""Checking a model for browser tabs: one export and gate per (model, config, microbatch), off the request.

A campaign asks with ``request_check`` when it starts (and when its model is
saved); the row is created pending, and a Celery task (``tasks``) takes it
with ``run_check``: exactly one worker wins a pending row (a conditional
update), and a row whose worker died is taken again after
``CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S``. The export and gate take seconds to
minutes of CPU, so with eager Celery (the embedded default, no worker) they
run in a background thread, never inside the request that started the campaign.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from .models import BrowserGraph, config_sha256, graph_storage_name

logger = logging.getLogger(__name__)

Status = BrowserGraph.Status

OFF_REASON = "browser compute is turned off on this site (CROWDTRAIN_BROWSER_GRAPHS)"
UNCHECKED_REASON = "its model is being checked for browsers"
# The most a tab may need with the wide graph: half of what a tab on a device of 2 GiB may use. Past it the
# wide graph's activations would start to decide which devices a tab refuses.
WIDE_MEMORY_BYTES = 1 << 29


@dataclass(frozen=True)
class Verdict:
    """What a lease, a page or the API says about browsers for one campaign's model."""

    status: str  # BrowserGraph.Status, or "pending" when no row exists yet
    reason: str
    graph: BrowserGraph | None = None


def key_of(model_name: str, model_config: Mapping[str, Any], microbatch_size: int) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "config_sha256": config_sha256(dict(model_config)),
        "microbatch_size": int(microbatch_size),
    }


def verdict_for(model_name: str, model_config: Mapping[str, Any], microbatch_size: int) -> Verdict:
    """The stored verdict on this model for browsers; one indexed query."""
    if not settings.CROWDTRAIN_BROWSER_GRAPHS:
        return Verdict(Status.REFUSED, OFF_REASON)
    graph = BrowserGraph.objects.filter(**key_of(model_name, model_config, microbatch_size)).first()
    if graph is None:
        return Verdict(Status.PENDING, UNCHECKED_REASON)
    if graph.status == Status.PENDING:
        return Verdict(Status.PENDING, UNCHECKED_REASON, graph)
    return Verdict(graph.status, graph.reason, graph)


def request_check(
    model_name: str,
    model_config: Mapping[str, Any],
    microbatch_size: int,
    *,
    again: bool = False,
    queue: bool = True,
) -> BrowserGraph | None:
    """Make sure this model's graphs are (being) checked: create the row, and queue its check after the commit.

    Nothing is queued for a row already decided, or pending with a live worker;
    ``again`` checks a decided row once more (a newer exporter, a fixed bug).
    ``queue=False`` only creates (or resets) the row, for a caller that runs ``run_check`` itself.
    Returns the row, or None when browser compute is off.
    """
    if not settings.CROWDTRAIN_BROWSER_GRAPHS:
        return None
    key = key_of(model_name, model_config, microbatch_size)
    try:
        with transaction.atomic():  # a savepoint: a lost race leaves the caller's transaction usable
            graph, _ = BrowserGraph.objects.get_or_create(**key, defaults={"model_config": dict(model_config)})
    except IntegrityError:  # another request created it between our read and our insert
        graph = BrowserGraph.objects.get(**key)
    if again and graph.status != Status.PENDING:
        BrowserGraph.objects.filter(pk=graph.pk).update(status=Status.PENDING, started_at=None)
        graph.status, graph.started_at = Status.PENDING, None
    if queue and graph.status == Status.PENDING and (graph.started_at is None or graph.started_at < _stale_before()):
        graph_id = graph.pk
        transaction.on_commit(lambda: dispatch(graph_id))
    return graph


def dispatch(graph_id: int) -> None:
    """Queue the check: to a worker, or with eager Celery to a process of its own (the request returns at once)."""
    from .tasks import check_browser_graph  # tasks imports this module

    if settings.CELERY_TASK_ALWAYS_EAGER and settings.CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND:
        start_checker(graph_id)
    else:
        check_browser_graph.delay(graph_id)


def start_checker(graph_id: int) -> subprocess.Popen[bytes]:
    """``manage.py check_browser_graphs --graph ID`` in a process of its own, left to run to its end.

    Not a thread of this process: the export traces with torch.fx, whose state is the process's, and a
    request building a model meanwhile (a campaign's validation) failed inside torch (KeyError 'custom'
    in fx.traceback). A process of its own also outlives a short-lived parent (seed_run, make demo),
    keeps onnx and the exporter out of the site's memory, and writes its lines to the site's log.
    """
    manage = Path(settings.BASE_DIR) / "manage.py"
    argv = [sys.executable, str(manage), "check_browser_graphs", "--graph", str(graph_id)]
    logger.info("browser graph %s: checking in a process of its own", graph_id)
    # In this process's group: whoever stops the site's group (the launcher, a terminal's Ctrl-C) stops the
    # check with it; a parent that simply exits (seed_run) leaves it to finish.
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)  # noqa: S603 (our own argv)


def _stale_before() -> datetime:
    return timezone.now() - timedelta(seconds=settings.CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S)


def claim(graph_id: int) -> datetime | None:
    """Take a pending row for this worker: when it was taken; None when another worker has it or it is decided."""
    stamp = timezone.now()
    free = Q(started_at__isnull=True) | Q(started_at__lt=_stale_before())
    taken = BrowserGraph.objects.filter(free, pk=graph_id, status=Status.PENDING).update(started_at=stamp)
    return stamp if taken else None


def run_check(graph_id: int) -> BrowserGraph | None:
    """Export and gate a pending row's graphs and store the verdict; None when there was nothing to do.

    Idempotent: a row decided, taken by a live worker, or gone is left alone.
    Never raises for a model's sake: a refused export or a failed gate is the
    verdict; anything unexpected becomes a refusal that asks to be reported.
    """
    stamp = claim(graph_id)
    if stamp is None:
        return None
    graph = BrowserGraph.objects.get(pk=graph_id)
    began = time.monotonic()
    try:
        fields = _check(graph)
    except Exception as error:
        logger.exception("browser graph %s (%s, microbatch %s): the check failed", graph_id, graph.model_name,
                         graph.microbatch_size)  # fmt: skip
        fields = {
            "status": Status.REFUSED,
            "reason": (
                f"{graph.model_name}: the check for browsers failed unexpectedly ({type(error).__name__}: "
                f"{str(error)[:300]}); browser compute stays off. This is a bug of the site: please report it "
                "to its admins with this message"
            ),
        }
    fields.update(seconds=time.monotonic() - began, checked_at=timezone.now())
    # Only the worker that holds the row writes it: one that took over a stale row wins over a late original.
    stored = BrowserGraph.objects.filter(pk=graph_id, started_at=stamp).update(**fields)
    if not stored:
        logger.info("browser graph %s: another worker took it over; this verdict is dropped", graph_id)
        return None
    graph.refresh_from_db()
    logger.info("browser graph %s (%s, microbatch %s): %s in %.1f s", graph_id, graph.model_name,
                graph.microbatch_size, graph.status, graph.seconds or 0.0)  # fmt: skip
    return graph


def _check(graph: BrowserGraph) -> dict[str, Any]:
    from .gate import check_browser_compute  # loads torch's exporter and onnxruntime: seconds, only here
    from .memory import memory_bytes

    sizes = [graph.microbatch_size, *([1] if graph.microbatch_size > 1 else [])]
    results = []
    for size in sizes:
        exported, verdict = check_browser_compute(graph.model_name, graph.model_config, size)
        results.append((exported, verdict))
        if exported is None or not verdict.passed:
            break
    worst = max((verdict for _, verdict in results), key=lambda v: (not v.passed, v.ratio))
    fields: dict[str, Any] = {
        "graph_error": worst.onnx.relative if worst.onnx is not None else None,
        "torch_error": worst.pytorch.relative if worst.pytorch is not None else None,
        "ratio": worst.ratio if math.isfinite(worst.ratio) else None,
        "manifest": results[0][0].manifest.to_dict() if results[0][0] is not None else {},
    }
    failed = next((verdict for _, verdict in results if not verdict.passed), None)
    if failed is not None:
        one = len(results) == 2 and failed is results[1][1]
        needs = " (the graph for a single sample, which a lease's last microbatch needs)" if one else ""
        reason = f"{failed.reason}{needs}"
        return {**fields, "status": Status.REFUSED, "reason": reason}
    onnx_bytes = [exported.onnx for exported, _ in results if exported is not None]
    for exported, _ in results:
        if exported is not None:
            _store(exported.sha256, exported.onnx)
    first = results[0][0]
    second = results[1][0] if len(results) == 2 else None
    if first is None:  # unreachable: a passed verdict has its graph; kept for the type checker
        raise RuntimeError("a passed gate without its graph")
    single = onnx_bytes[1] if len(onnx_bytes) == 2 else None
    wide = _wide(graph, onnx_bytes[0], single)
    return {
        **fields,
        "status": Status.PASSED,
        "reason": worst.reason,
        "sha256": first.sha256,
        "bytes": len(first.onnx),
        "sha256_one": second.sha256 if second is not None else "",
        "bytes_one": len(second.onnx) if second is not None else 0,
        # with the wide graph, _wide measured it (shape inference of every graph, once)
        "memory_bytes": wide["memory_bytes"] if wide else memory_bytes(onnx_bytes[0], single),
        **wide,
    }


def _wide(graph: BrowserGraph, main: bytes, one: bytes | None) -> dict[str, Any]:
    """The wide graph's fields when it passes its gate and a tab can hold it; else none (tabs run microbatches).

    Not passing is no refusal: the microbatch's graph computes the same sum, run by run.
    """
    from .gate import check_wide
    from .memory import memory_bytes

    microbatches = settings.CROWDTRAIN_BROWSER_WIDE_MICROBATCHES
    if microbatches <= 1:
        return {}
    exported, verdict = check_wide(graph.model_name, graph.model_config, graph.microbatch_size, microbatches)
    if exported is None or not verdict.passed:
        logger.info("browser graph %s: no wide graph of %d microbatches: %s", graph.pk, microbatches, verdict.reason)
        return {}
    total = memory_bytes(main, one, exported.onnx)
    if total > WIDE_MEMORY_BYTES:
        logger.info("browser graph %s: no wide graph: a tab would need %d bytes with it", graph.pk, total)
        return {}
    _store(exported.sha256, exported.onnx)
    return {
        "wide_size": exported.manifest.microbatch_size,
        "sha256_wide": exported.sha256,
        "bytes_wide": len(exported.onnx),
        "memory_bytes": total,
    }


def _store(sha256: str, data: bytes) -> None:
    name = graph_storage_name(sha256)
    if not default_storage.exists(name):  # content-addressed: the same bytes, whoever wrote them first
        default_storage.save(name, ContentFile(data))

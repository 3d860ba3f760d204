"""Load-generator results: counters survive JSON, and several processes' results merge into one."""

from __future__ import annotations

import json
import math

from tests.benchmarks.loadgen import Stats
from tests.benchmarks.scale import merge_results


def test_counters_keep_their_reasons_in_json() -> None:
    stats = Stats()
    stats.done_rejected["lease expired"] += 3
    stats.lease_ms.append(1.23456)

    data = json.loads(json.dumps(stats.to_json()))

    assert data["done_rejected"] == {"lease expired": 3}
    assert data["lease_ms"] == [1.23]


def test_it_sums_counts_and_joins_latencies_of_several_processes() -> None:
    a, b = Stats(agents=2, cycles=5), Stats(agents=3, cycles=7)
    a.lease_ms += [1.0, 2.0]
    b.lease_ms += [3.0]
    a.done_rejected["lease expired"] += 1
    b.done_rejected["lease expired"] += 2
    b.done_rejected["stale version"] += 1
    a.loop_lag_max_ms, b.loop_lag_max_ms = 12.0, 40.0

    merged = merge_results([json.loads(json.dumps(s.to_json())) for s in (a, b)])

    assert merged["agents"] == 5 and merged["cycles"] == 12
    assert sorted(merged["lease_ms"]) == [1.0, 2.0, 3.0]
    assert merged["done_rejected"] == {"lease expired": 3, "stale version": 1}
    assert merged["loop_lag_max_ms"] == 40.0
    assert all(math.isinf(t) for t in merged["window"])

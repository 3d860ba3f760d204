"""Every Prometheus metric the site's own code changes, in one place (scrape-time gauges: ``collectors``).

Per process, not prometheus_client's multiprocess mode: each daphne process is
scraped on its own, as each aggregator is (deploy/prometheus/prometheus.yml finds
them by DNS), and dashboards ``sum`` counters and histograms over processes.
Multiprocess mode needs a folder of memory-mapped files shared by the processes
of one machine and wiped at every restart, which site processes on several
machines or containers do not have. The gauges read from the database and Redis
are the same on every process; dashboards take their ``max``.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import Counter, Histogram

# Latencies of the lease path: a lease is decided in about a millisecond; a queue behind a busy
# process or a slow database shows as the upper buckets filling.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

LEASE_REQUEST_SECONDS = Histogram(
    "crowdtrain_lease_request_seconds",
    "Time to answer one lease request (a lease or a refusal), not counting a wait for room",
    buckets=LATENCY_BUCKETS,
)
STEP_COMMIT_SECONDS = Histogram(
    "crowdtrain_step_commit_seconds",
    "Time to write one committed step (its row, its leases and their credit) to the database",
    buckets=LATENCY_BUCKETS,
)
STEP_COUNTER_REPAIRS = Counter(
    "crowdtrain_step_counter_repairs",
    "Times the site found a campaign's step counter off its step rows and repaired it (scheduler.invariants)",
    ["campaign"],
)
STEPS_DISCARDED = Counter(
    "crowdtrain_steps_discarded",
    "Full steps whose write a rollback overtook: discarded whole, their samples redone (scheduler.commits)",
    ["campaign"],
)
LEASE_OUTCOMES = Counter(
    "crowdtrain_lease_outcomes",
    "Leases that ended, by how: accepted, expired, released or rejected, and a short reason",
    ["campaign", "state", "reason"],
)

# Reasons are free text with numbers in them ("stale version: computed on 3, step 5 is open"): a label
# takes the fixed part, so the number of series stays small.
_REASONS = (
    ("deadline passed", "deadline passed"),
    ("stale version", "stale version"),
    ("lease has ", "sample count mismatch"),
    ("missing or invalid receipt", "bad receipt"),
    ("loss ", "bad loss"),
    ("rolled back", "rolled back"),
    ("the backup lease finished first", "duplicate"),
    ("the original lease finished first", "duplicate"),
    ("agent disconnected", "agent disconnected"),
    ("released by the agent", "released by the agent"),
    ("volunteer quarantined", "volunteer quarantined"),
)
FAILED_STATES = ("expired", "rejected")
WINDOW_S = 600.0  # the lease-failure alert judges the last 10 minutes


def reason_label(reason: str) -> str:
    """The bounded label of a lease's end reason ("" for accepted leases, "other" for anything unlisted)."""
    if not reason:
        return ""
    for prefix, label in _REASONS:
        if reason.startswith(prefix):
            return label
    return "other"


class OutcomeWindow:
    """Lease outcomes of the last ``WINDOW_S`` seconds, per campaign, in this process (for ``health``).

    One bucket per minute; adding costs a lock and a dict update, never I/O.
    Behind a least-connections balancer each process sees a fair share of a
    campaign's leases, so the share it sees is the campaign's; Prometheus's
    own rule sums every process (deploy/prometheus/alerts.yml).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (minute, {(campaign, failed): count})
        self._buckets: deque[tuple[int, dict[tuple[int, bool], int]]] = deque()
        self.clock = time.time  # tests move it

    def add(self, campaign_id: int, state: str, count: int = 1) -> None:
        minute = int(self.clock() // 60)
        key = (campaign_id, state in FAILED_STATES)
        with self._lock:
            if not self._buckets or self._buckets[-1][0] != minute:
                self._buckets.append((minute, {}))
                self._trim(minute)
            counts = self._buckets[-1][1]
            counts[key] = counts.get(key, 0) + count

    def _trim(self, minute: int) -> None:
        oldest = minute - int(WINDOW_S // 60)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def totals(self) -> dict[int, tuple[int, int]]:
        """Per campaign: (failed, all) outcomes in the window."""
        now_minute = int(self.clock() // 60)
        oldest = now_minute - int(WINDOW_S // 60) + 1
        totals: dict[int, tuple[int, int]] = {}
        with self._lock:
            for minute, counts in self._buckets:
                if minute < oldest:
                    continue
                for (campaign_id, failed), count in counts.items():
                    bad, total = totals.get(campaign_id, (0, 0))
                    totals[campaign_id] = (bad + (count if failed else 0), total + count)
        return totals

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()


outcomes = OutcomeWindow()


def lease_ended(campaign_id: int | None, state: str, reason: str) -> None:
    """Count one lease that ended (called where leases end: ``scripts.record_retired`` and accepted reports).

    ``campaign_id`` None (a caller that does not know it) counts under campaign "" and not in the window.
    """
    LEASE_OUTCOMES.labels("" if campaign_id is None else str(campaign_id), str(state), reason_label(reason)).inc()
    if campaign_id is not None:
        outcomes.add(campaign_id, str(state))

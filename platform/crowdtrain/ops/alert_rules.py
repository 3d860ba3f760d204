"""Prometheus's alerting rules, declared from the same thresholds and codes as the site's health checks.

``deploy/prometheus/alerts.yml`` is written from ``rules()`` by ``manage.py write_alert_rules``; a test
fails when the committed file differs, so a threshold changed in ``health`` or in the settings cannot
leave Prometheus judging by the old one.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

from django.conf import settings

from crowdtrain.lib.metrics import WINDOW_S

from . import health

HEADER = """\
# Written by `python manage.py write_alert_rules` from crowdtrain/ops/alert_rules.py: edit that, not this.
# The site's own alerts (crowdtrain.ops.health), stated in PromQL with the same thresholds, plus the ones
# only Prometheus can see (a target that stopped answering).
"""
WIDTH = 110


@dataclass(frozen=True)
class PromRule:
    """One alerting rule of the file; ``why`` is the comment written above it."""

    alert: str
    expr: str
    severity: str
    summary: str
    what_to_do: str = ""
    description: str = ""
    for_: str = ""
    why: str = ""


def duration(seconds: float) -> str:
    """A PromQL duration: whole minutes as ``10m``, anything else in seconds."""
    return f"{seconds / 60:g}m" if seconds % 60 == 0 else f"{seconds:g}s"


def rules() -> list[PromRule]:
    """Every rule, with the thresholds the site itself judges by."""
    gone_s = settings.CROWDTRAIN_GONE_AFTER_S
    stalled = duration(settings.CROWDTRAIN_STALLED_AFTER_MIN * 60)
    stalled_words = f"{settings.CROWDTRAIN_STALLED_AFTER_MIN:g} minutes"
    window = duration(WINDOW_S)
    excusing = "|".join(
        (health.AGGREGATOR_SILENT, health.CAMPAIGN_WAITING, health.CAMPAIGN_BLOCKED, health.CAMPAIGN_NO_VOLUNTEERS)
    )
    return [
        PromRule(
            "CrowdtrainSiteAlert",
            "max by (code, campaign, severity) (crowdtrain_alert) == 1",
            "{{ $labels.severity }}",
            "{{ $labels.code }} (campaign {{ $labels.campaign }})",
            description="GET /healthz on any site process names the campaign and says what to do.",
            for_="1m",
            why="Every alert the site evaluates itself, as the crowdtrain_alert gauge: one rule, its code in the "
            "labels.",
        ),
        PromRule(
            "AggregatorSilent",
            f"(max by (aggregator) (crowdtrain_aggregator_heartbeat_age_seconds) > {gone_s:g}\n"
            "  or max by (aggregator) (crowdtrain_aggregator_connected) == 0)\n"
            "and max by (aggregator) (crowdtrain_aggregator_running_slices) > 0",
            "critical",
            "aggregator {{ $labels.aggregator }} is silent; its campaigns give no leases",
            "Check the aggregator's process and log on its host; restart it with the same --name so the site gives "
            "it its slices back, or start a replacement with that name: it resumes from the newest complete "
            "checkpoint.",
            for_="30s",
            why=f"Heartbeat older than CROWDTRAIN_GONE_AFTER_S ({gone_s:g} s), or its socket closed, while it holds "
            "slices of a running campaign: a token whose aggregator never started, or one whose campaigns ended, "
            "stalls nothing.",
        ),
        PromRule(
            "CampaignStalled",
            'max by (campaign) (crowdtrain_campaign_info{state="running"})\n'
            f'and max by (campaign) (crowdtrain_campaign_info{{state="running"}} offset {stalled})\n'
            f"and max by (campaign) (changes(crowdtrain_campaign_committed_steps[{stalled}])) == 0\n"
            "unless max by (campaign)\n"
            f'  (crowdtrain_alert{{code=~"{excusing}"}}\n'
            f'    or crowdtrain_alert{{code="{health.CHECKPOINTS_BEHIND}",severity="critical"}})',
            "critical",
            f"campaign {{{{ $labels.campaign }}}} is running but committed no step in {stalled_words}",
            "Volunteers' agents are there but no step completes: leases that all expire or are rejected point at "
            "a broken agent version or dataset; otherwise read the site's log for the campaign's id.",
            why=f"Running now and CROWDTRAIN_STALLED_AFTER_MIN ({stalled_words}) ago, and no step committed since, "
            "which includes a campaign that never committed one; not while a silent aggregator, missing "
            "aggregators, a block, checkpoints past the bound or the want of volunteers explain it (their own "
            "alerts say what to do; the last is only a warning).",
        ),
        PromRule(
            "CampaignWaitingForAggregators",
            f'max by (campaign) (crowdtrain_alert{{code="{health.CAMPAIGN_WAITING}"}}) == 1',
            "critical",
            "campaign {{ $labels.campaign }} is running without all its aggregators ready",
            "Start aggregators until the campaign's count is connected (python -m crowdtrain_backbone with a token "
            "from manage.py create_backbone_token); one connected but not ready is loading a checkpoint.",
            for_="1m",
        ),
        PromRule(
            "LeaseFailuresSpike",
            f'(sum by (campaign) (increase(crowdtrain_lease_outcomes_total{{state=~"expired|rejected"}}[{window}]))\n'
            f"  / sum by (campaign) (increase(crowdtrain_lease_outcomes_total[{window}]))"
            f" > {settings.CROWDTRAIN_LEASE_FAILURE_SHARE:g})\n"
            f"and sum by (campaign) (increase(crowdtrain_lease_outcomes_total[{window}])) >= {health.MIN_OUTCOMES}",
            "warning",
            "campaign {{ $labels.campaign }}: most leases expire or are rejected",
            "Read the reasons in crowdtrain_lease_outcomes_total: 'deadline passed' means agents die or are too "
            "slow for their leases; 'stale version' means aggregators apply steps slowly; 'bad receipt' points at "
            "an aggregator that restarted; many rejections from one volunteer are for the review queue.",
            why=f"Expired and rejected leases above CROWDTRAIN_LEASE_FAILURE_SHARE "
            f"({settings.CROWDTRAIN_LEASE_FAILURE_SHARE:g}) of a campaign's outcomes in {WINDOW_S / 60:g} minutes, "
            f"with at least {health.MIN_OUTCOMES} outcomes, summed over every site process.",
        ),
        PromRule(
            "CeleryTaskFailing",
            "time() - max by (task) (crowdtrain_celery_task_last_failure_timestamp_seconds)"
            f" < {health.TASK_FAILURE_WINDOW_S:g}",
            "warning",
            f"Celery task {{{{ $labels.task }}}} failed in the last {health.TASK_FAILURE_WINDOW_S / 60:g} minutes",
            "Read the Celery worker's log for the traceback; check that worker and beat run (docker compose ps "
            "worker beat) and reach PostgreSQL, Redis and the storage.",
        ),
        PromRule(
            "StepCounterRepaired",
            "sum by (campaign) (increase(crowdtrain_step_counter_repairs_total[1h])) > 0",
            "warning",
            "campaign {{ $labels.campaign }}: its step counter was off its step rows and was repaired",
            'Read the site\'s log around "the step counter says" for the campaign: the steps it redid are named '
            "there. A repeat is a bug worth reporting with that log; the campaign itself needs nothing more unless "
            "/healthz says it is blocked.",
            why="The site found a campaign's step counter off its step rows (scheduler.invariants) and rolled it "
            "back to a complete checkpoint, or blocked it: it cannot happen unless a commit and a rollback were "
            "misordered.",
        ),
        PromRule(
            "CheckpointWritesFailing",
            "sum by (instance) (increase(crowdtrain_backbone_checkpoint_failures_total[5m])) > 0",
            "warning",
            "aggregator {{ $labels.instance }} cannot write its checkpoints",
            "Read the aggregator's log for the storage error; check the S3 endpoint and credentials, or the "
            "checkpoint disk's free space. Past the bound (CROWDTRAIN_CHECKPOINT_LAG_MAX checkpoint intervals) its "
            "campaigns take no work until a checkpoint is written; they go on by themselves then.",
            why=f"Each refused checkpoint is written again every few seconds; the site's {health.CHECKPOINTS_BEHIND} "
            "alert says when that lag matters, this one says which aggregator cannot write.",
        ),
        PromRule(
            "TargetDown",
            'up{job=~"crowdtrain-.*"} == 0',
            "critical",
            "{{ $labels.job }} {{ $labels.instance }} does not answer /metrics",
            "A site process answers 503 when it cannot read PostgreSQL or Redis (its log says which); no answer at "
            "all means the process is down: docker compose ps, then its log.",
            for_="1m",
        ),
    ]


def render(declared: list[PromRule] | None = None) -> str:
    """The rules as Prometheus's YAML rule file; long texts folded, expressions kept line for line."""
    lines = [HEADER.rstrip("\n"), "groups:", "  - name: crowdtrain", "    rules:"]
    for index, rule in enumerate(rules() if declared is None else declared):
        if index:
            lines.append("")
        lines += textwrap.wrap(rule.why, WIDTH, initial_indent="      # ", subsequent_indent="      # ")
        lines.append(f"      - alert: {rule.alert}")
        if "\n" in rule.expr:
            lines.append("        expr: |-")
            lines += [f"          {line}" for line in rule.expr.splitlines()]
        else:
            lines.append(f"        expr: {_quoted(rule.expr)}")
        if rule.for_:
            lines.append(f"        for: {rule.for_}")
        lines.append(f"        labels: {{severity: {_quoted(rule.severity)}}}")
        lines.append("        annotations:")
        lines.append(f"          summary: {_quoted(rule.summary)}")
        for key, text in (("description", rule.description), ("what_to_do", rule.what_to_do)):
            if text:
                lines.append(f"          {key}: >-")
                lines += textwrap.wrap(text, WIDTH, initial_indent=" " * 12, subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    # A JSON string is a YAML double-quoted scalar; plain words stay plain, as a person would write them.
    plain = text.replace("_", "").replace("-", "").isalnum()
    return text if plain else json.dumps(text)

"""Which campaigns a browser tab may lease: only those whose gradient graphs passed the gate, in sync mode.

A tab computes with the campaign's exported graph (``crowdtrain.browser``), so
it gets no lease of a campaign whose graph is refused or still being checked,
nor of one in local mode (a graph computes one gradient, not inner steps).
The lease path asks once per request, so both answers come from per-process
caches: the device's kind from its hello (dropped when its socket closes), the
campaign's verdict re-read every ``VERDICT_TTL_S``. Any other device is never
looked at twice.
"""

from __future__ import annotations

import threading
import time

from crowdtrain.accounts.models import Device
from crowdtrain.browser.models import BrowserGraph
from crowdtrain.campaigns.browser_checks import browser_verdict, check_for_browsers
from crowdtrain.campaigns.models import Campaign
from crowdtrain_agent.protocol import NoLease

from .configs import CampaignConfig

BROWSER = "browser"  # DeviceInfo.kind of a tab (protocol 2.10)
# A verdict changes once per campaign (pending -> passed or refused): a tab sees it within this long.
VERDICT_TTL_S = 5.0
# A tab refused asks again this often: a check takes a minute or so; a refusal stays until a new check.
RETRY_S = 30.0

_kinds: dict[int, str] = {}
_verdicts: dict[int, tuple[float, str, str]] = {}  # campaign id -> (read at, status, reason)
_lock = threading.Lock()


def note_kind(device_id: int, kind: str) -> None:
    """What the device's hello said it is; the lease path reads it without a query."""
    _kinds[device_id] = kind


def forget_device(device_id: int) -> None:
    """The device's socket closed: its entry goes, so the cache holds the devices connected, not all ever seen."""
    _kinds.pop(device_id, None)


def is_browser(device_id: int) -> bool:
    kind = _kinds.get(device_id)
    if kind is None:  # a hello handled by another site process: the stored hardware says
        hardware = Device.objects.filter(pk=device_id).values_list("hardware", flat=True).first() or {}
        kind = str(hardware.get("kind") or "") if isinstance(hardware, dict) else ""
        note_kind(device_id, kind)
    return kind == BROWSER


def refusal(config: CampaignConfig, device_id: int) -> NoLease | None:
    """Why this device gets no lease of this campaign because it is a tab; None for any other device."""
    if not is_browser(device_id):
        return None
    status, reason = _verdict(config.id)
    if status == BrowserGraph.Status.PASSED:
        return None
    if status == BrowserGraph.Status.PENDING:
        detail = f"browser compute is not offered for campaign {config.id} yet: its model is being checked"
    else:
        detail = f"browser compute is not offered for campaign {config.id}: {reason}"
    return NoLease(reason="campaign_paused", detail=detail[:1000], retry_after_s=RETRY_S, ready_at_step=None)


def _verdict(campaign_id: int) -> tuple[str, str]:
    now = time.monotonic()
    hit = _verdicts.get(campaign_id)
    if hit is not None and now - hit[0] < VERDICT_TTL_S:
        return hit[1], hit[2]
    campaign = (
        Campaign.objects.only("pk", "architecture", "model_config", "microbatch_size", "training_mode")
        .filter(pk=campaign_id)
        .first()
    )
    status: str
    if campaign is None:
        status, reason = BrowserGraph.Status.REFUSED, "it no longer exists"
    else:
        verdict = browser_verdict(campaign)
        status, reason = verdict.status, verdict.reason
        if status == BrowserGraph.Status.PENDING:
            # A check queued by a process that exited first (seed_run's eager thread) or whose worker died
            # would stay pending for ever: a tab asking is what queues it again (once per VERDICT_TTL_S).
            check_for_browsers(campaign)
    with _lock:
        _verdicts[campaign_id] = (now, status, reason)
    return status, reason


def clear_caches() -> None:
    with _lock:
        _kinds.clear()
        _verdicts.clear()

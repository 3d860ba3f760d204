"""What volunteers do with their devices: name them, read their hardware, set their controls, revoke them."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import msgspec
from django.utils import timezone

from crowdtrain.accounts.models import Device
from crowdtrain_agent.protocol import DeviceControls

from .signals import device_controls_changed, device_revoked

logger = logging.getLogger(__name__)

MAX_NAME = 100  # Device.name and DeviceAuthorization.requested_name


def clean_device_name(raw: Any) -> str:
    """A device name a person can read: whitespace collapsed, printable, 1 to 100 characters.

    Raises:
        ValueError: saying what is wrong with the name.
    """
    name = " ".join(str(raw or "").split())
    if not name:
        raise ValueError("the device name is empty; give it a name like 'desk-gpu'")
    if len(name) > MAX_NAME:
        raise ValueError(f"the device name has {len(name)} characters; use at most {MAX_NAME}")
    if not name.isprintable():
        raise ValueError("the device name holds control characters; use letters, digits and punctuation")
    return name


def online_ids(devices: list[Device]) -> set[int]:
    """Which of these devices hold a socket to the site now: the scheduler's presence set, one read for all.

    The database's ``last_seen_at`` is written about once a minute and is for
    "last seen 3 days ago"; the presence set is what the scheduler trusts.
    """
    from crowdtrain.scheduler.hotstate import hot_state

    state = hot_state()
    seen = state.last_seen([d.pk for d in devices if not d.is_revoked])
    since = state.online_since()
    return {device_id for device_id, at in seen.items() if at >= since}


def revoke(device: Device, reason: str) -> bool:
    """Revoke a device's token and close its agent's sockets (close code 4003).

    Returns:
        True if this call revoked it, False if it was revoked already.
    """
    revoked = bool(Device.objects.filter(pk=device.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()))
    # Sent even when it was revoked already: a socket opened just before the first revocation still goes.
    device_revoked.send(sender=Device, device_id=device.pk, reason=reason)
    if revoked:
        logger.info("device %s of %s revoked: %s", device.pk, device.owner_id, reason)
    return revoked


def set_controls(device: Device, controls: dict[str, Any]) -> None:
    """Store a device's controls (as ``clean_controls`` gives them) and hand them to its agent if it is connected."""
    Device.objects.filter(pk=device.pk).update(controls=controls)
    device_controls_changed.send(sender=Device, device_id=device.pk, controls=controls)


def _bytes(value: Any) -> str | None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        return None
    return f"{value / 2**30:.1f} GiB"


def _flops(value: Any) -> str | None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        return None
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 1e6:.1f} MFLOP/s"


def hardware_summary(hardware: dict[str, Any]) -> list[tuple[str, str]]:
    """Label/value rows for a page, from what the agent reported at login (host, OS) and in hello (device, speed).

    Every value came from a volunteer's machine: templates escape it, and
    nothing here trusts its type.
    """
    hardware = hardware if isinstance(hardware, dict) else {}
    kind, name = hardware.get("kind"), hardware.get("name")  # hello
    accelerator = hardware.get("accelerator")  # login
    if kind == "browser":  # a tab (protocol 2.10): its runtime says what computes, as PyTorch does for agents
        compute = f"{name} (browser tab)" if name else "browser tab"
    elif kind and name:
        compute = f"{name} ({kind})"
    elif accelerator:
        compute = str(accelerator)
    else:
        compute = None
    rows = [
        ("Compute", compute),
        ("Memory", _bytes(hardware.get("memory_bytes")) or _bytes(hardware.get("accelerator_memory_bytes"))),
        ("Benchmark", _flops(hardware.get("flops_per_s"))),
        ("CPU threads", hardware.get("threads") or hardware.get("cpu_count")),
        ("Operating system", hardware.get("os")),
        ("Host name", hardware.get("hostname")),
        ("PyTorch", hardware.get("torch_version")),
        ("Runtime", hardware.get("runtime")),
        ("Agent", hardware.get("agent_version")),
    ]
    return [(label, str(value)) for label, value in rows if value not in (None, "")]


# The controls a volunteer may set on My devices, as the agent's controls file names them, with their bounds.
CONTROL_NUMBERS = {
    "idle_minutes": (0.0, 1440.0, "minutes without keyboard or mouse input"),
    "max_other_cpu_percent": (1.0, 100.0, "percent of the CPUs other programs may use"),
    "upload_kbps": (8.0, 1e8, "kilobits per second"),
    "download_kbps": (8.0, 1e8, "kilobits per second"),
    "threads": (1, 1024, "a whole number of CPU threads"),
    "gpu_memory_gb": (0.1, 4096.0, "gigabytes of the GPU's memory"),
}


def clean_controls(form: Mapping[str, str]) -> dict[str, Any]:
    """The controls a My devices form sets (blank: not set), checked as the agent checks its own.

    Raises:
        ValueError: naming the control and what it accepts.
    """
    from crowdtrain_agent.controls import ControlError, parse_schedule

    controls: dict[str, Any] = {}
    for name, (low, high, unit) in CONTROL_NUMBERS.items():
        raw = (form.get(name) or "").strip()
        if not raw:
            continue
        try:
            value: float = int(raw) if isinstance(low, int) else float(raw)  # threads: whole numbers only
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise ValueError(f"{name.replace('_', ' ')} must be a number from {low:g} to {high:g} ({unit})")
        controls[name] = value
    schedule = " ".join((form.get("schedule") or "").split())
    if schedule:
        if len(schedule) > 200:
            raise ValueError("the schedule is over 200 characters")
        try:
            parse_schedule(schedule)
        except ControlError as exc:
            raise ValueError(str(exc)) from None
        controls["schedule"] = schedule
    if form.get("pause_on_battery") in ("on", "true", "1"):
        controls["pause_on_battery"] = True
    return controls


def device_controls(device: Device) -> DeviceControls | None:
    """What the welcome tells the device's agent of its controls; None when none is set (or the stored ones
    no longer read: the agent then keeps its own)."""
    return stored_controls(device.controls)


def stored_controls(stored: Any) -> DeviceControls | None:
    """A device's stored controls as the protocol carries them; None when none is set or they no longer read."""
    if not isinstance(stored, dict) or not stored:
        return None
    try:
        return msgspec.convert(stored, DeviceControls)
    except msgspec.ValidationError:
        return None

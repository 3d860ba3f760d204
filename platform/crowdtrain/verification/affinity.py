"""How alike two volunteers look: a copy should go to someone unlikely to be the original's owner.

Signing up twice costs a second e-mail address, so two accounts that agree
prove little when they share a team, a machine, a network or the minute they
joined. Each volunteer has *tags*, one per such trait; two volunteers who share
a tag are *similar*. A copy waits a while for a volunteer who shares none
(``checks``); taken by a similar one, its agreement proves nothing and the
referee decides the check.

The traits, each only where known:

- the account itself and its team;
- each device's fingerprint: the host name the agent gave at login with the
  kind, name, memory and threads it reports (without a host name the rest
  describes a model of machine, not a machine, and counts as unknown);
- each device's network: the /24 (IPv4) or /48 (IPv6) it last connected from
  (behind ``CROWDTRAIN_TRUSTED_PROXY_COUNT`` proxies, the address the nearest
  one appended to X-Forwarded-For; ``client_address``); loopback, private, link-local and carrier-grade NAT
  addresses say nothing (every agent behind one proxy, one carrier or on one
  test machine would look like one person);
- when the account joined: ten-minute buckets, a neighbouring bucket counting.

A volunteer who spoofs all of these still meets the referee whenever an honest
volunteer copies their work or they copy an honest volunteer's, and loses.
"""

from __future__ import annotations

import hashlib
import ipaddress
import threading
import time
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model

from crowdtrain.accounts.models import Device

JOIN_BUCKET_S = 600
SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")
TAGS_TTL_S = 60.0
# Hardware fields that describe one machine once its host name is known (``collect_hardware``, hello).
FINGERPRINT_FIELDS = ("hostname", "kind", "name", "memory_bytes", "threads")

_lock = threading.Lock()
_tags: dict[tuple[int, bool], tuple[float, list[str]]] = {}


def network_prefix(address: str | None) -> str:
    """The /24 or /48 an address belongs to, or "" when it says nothing of who is behind it."""
    try:
        ip = ipaddress.ip_address((address or "").strip())
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return ""
    if ip in SHARED_SPACE:  # carrier-grade NAT: strangers behind one carrier share it
        return ""
    bits = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


def client_address(scope: dict[str, Any]) -> str:
    """The address a socket came from: behind ``CROWDTRAIN_TRUSTED_PROXY_COUNT`` proxies, the one the
    nearest of them appended to X-Forwarded-For (addresses to its left are whatever the client said)."""
    trusted = settings.ALLAUTH_TRUSTED_PROXY_COUNT
    if trusted > 0:
        forwarded = [
            part.strip()
            for name, value in scope.get("headers") or []
            if name.lower() == b"x-forwarded-for"
            for part in value.decode("latin-1").split(",")
        ]
        return forwarded[-trusted] if len(forwarded) >= trusted else ""
    client = scope.get("client") or ("", 0)
    return str(client[0])


def fingerprint(hardware: Any) -> str:
    """A short hash of what identifies one machine, or "" without a host name."""
    if not isinstance(hardware, dict) or not str(hardware.get("hostname") or "").strip():
        return ""
    text = "\x1f".join(str(hardware.get(field, "")) for field in FINGERPRINT_FIELDS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tags_of(volunteer_id: int, *, widen: bool = False) -> list[str]:
    """The volunteer's tags; ``widen`` adds the neighbouring join buckets (for the original's side).

    Cached for a minute per process: the copy path asks on every lease request while copies wait.
    """
    now = time.monotonic()
    with _lock:
        cached = _tags.get((volunteer_id, widen))
    if cached is not None and cached[0] > now:
        return cached[1]
    tags = _compute(volunteer_id, widen)
    with _lock:
        if len(_tags) > 100_000:
            _tags.clear()
        _tags[(volunteer_id, widen)] = (now + TAGS_TTL_S, tags)
    return tags


def _compute(volunteer_id: int, widen: bool) -> list[str]:
    tags = [f"v{volunteer_id}"]
    user = get_user_model().objects.filter(pk=volunteer_id).values("date_joined", "profile__team_id").first()
    if user is None:
        return tags
    if user["profile__team_id"] is not None:
        tags.append(f"t{user['profile__team_id']}")
    bucket = int(user["date_joined"].timestamp()) // JOIN_BUCKET_S
    tags += [f"j{b}" for b in ((bucket - 1, bucket, bucket + 1) if widen else (bucket,))]
    for hardware in Device.objects.filter(owner_id=volunteer_id, revoked_at__isnull=True).values_list(
        "hardware", flat=True
    ):
        if fp := fingerprint(hardware):
            tags.append(f"f{fp}")
        if isinstance(hardware, dict) and hardware.get("network"):  # a prefix, set by the site (``network_prefix``)
            tags.append(f"n{hardware['network']}")
    return sorted(set(tags))


def similar(a: list[str], b: list[str]) -> bool:
    return not set(a).isdisjoint(b)


def clear_caches() -> None:
    with _lock:
        _tags.clear()

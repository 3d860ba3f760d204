"""Who may read a ``/metrics`` endpoint, the site's and the aggregators' alike.

Metrics name campaigns, aggregators and volunteers' counts: not for the
public. With a token configured (production), a scrape must send
``Authorization: Bearer <token>``. Without one, only loopback and private
addresses are answered, and only requests that no proxy relayed: behind a
balancer every request comes from a private address, and a proxy's header
is what tells a stranger's request from Prometheus's. Proxies name the
client in many ways, so any of the common ones counts (``PROXY_HEADERS``).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

__all__ = ["PROXY_HEADERS", "relayed", "scrape_refusal"]

# Headers a proxy or CDN adds to say whom it relays for (RFC 7239's Forwarded, the de facto X-Forwarded-*,
# nginx's X-Real-IP, Cloudflare's, Akamai's, Fastly's, and HTTP's own Via), lower case.
PROXY_HEADERS = frozenset({
    "forwarded", "via", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port",
    "x-forwarded-server", "x-original-forwarded-for", "x-real-ip", "x-client-ip", "client-ip",
    "x-cluster-client-ip", "true-client-ip", "cf-connecting-ip", "fastly-client-ip", "x-proxyuser-ip",
})  # fmt: skip


def relayed(header_names: Iterable[str]) -> bool:
    """Whether a request with these header names came through a proxy; WSGI's ``HTTP_X_REAL_IP`` form works too."""
    for name in header_names:
        plain = name.lower().removeprefix("http_").replace("_", "-")
        if plain in PROXY_HEADERS:
            return True
    return False


def scrape_refusal(
    token: str, authorization: str | None, header_names: Iterable[str], remote_address: str | None, *, setting: str
) -> tuple[int, str] | None:
    """Why a scrape is refused, as (HTTP status, message naming ``setting``); None if it may read.

    Args:
        token: the configured metrics token ("" for none).
        authorization: the request's Authorization header, if any.
        header_names: the names of all the request's headers.
        remote_address: the address the connection came from.
        setting: the name of the token's setting, for the message.
    """
    if token:
        scheme, _, sent = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), token.encode()):
            return 401, f"send the metrics token as Authorization: Bearer ({setting})"
        return None
    try:
        ip = ipaddress.ip_address(remote_address or "")
    except ValueError:
        ip = None
    if ip is None or not (ip.is_loopback or ip.is_private) or relayed(header_names):
        return 403, f"metrics are served to the deployment's own network only; set {setting} to scrape from elsewhere"
    return None

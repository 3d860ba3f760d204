"""The agent's one HTTP client: connections kept open per server, so a step's downloads skip the TCP handshake.

Every step an agent downloads each slice's parameters (in parts for large
slices) and checks the version it holds with a conditional GET per slice;
shards come from the site. A new connection per request cost a round trip
each, more over a home link than the small answers themselves. urllib3's pool
keeps a few connections per server, shared by the agent's download threads.
Login (``login``) and the site's read of each aggregator's /metrics
(``crowdtrain.ops.aggregator_probe``) go through it too: one client, one set of
errors to catch. Like urllib, it goes through the proxy the environment names.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import HTTPError as Urllib3Error

logger = logging.getLogger(__name__)

# Connections kept per server: a lease's download and the next lease's prefetch may run at once.
CONNECTIONS_PER_SERVER = 4
# An error body (a JSON reason) up to this size is read to the end so its connection can be reused;
# anything longer left unread closes the connection instead.
DRAIN_LIMIT_BYTES = 64 << 10
# No retries of a request, as before the pool, with one exception: a kept connection the server has
# closed meanwhile (its idle timeout) fails the first read, and the request goes once more on a new one.
# Redirects are followed as urllib followed them.
# urllib3 reads a body into a new bytes object, then copies it into the caller's buffer: read in pieces
# this size, the copy is made while the piece is still in the CPU's cache, and the temporary stays small.
READ_PIECE_BYTES = 1 << 20
RETRIES = urllib3.Retry(total=None, connect=0, read=1, redirect=5, status=0, other=0, raise_on_status=False)

USER_AGENT = "crowdtrain-agent"

POOL = urllib3.PoolManager(num_pools=16, maxsize=CONNECTIONS_PER_SERVER, block=False, retries=RETRIES)
# Never sent through a proxy, whatever NO_PROXY says: a proxy cannot reach this machine's own services.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_proxies: dict[str, urllib3.ProxyManager] = {}
_proxies_lock = threading.Lock()


def _manager_for(url: str) -> urllib3.PoolManager:
    """The pool for ``url``: through the proxy the environment names for its scheme, as urllib went.

    urllib3 reads no proxy settings itself, and a volunteer behind a proxy (``HTTPS_PROXY``,
    ``NO_PROXY``) must reach the site and the aggregators the way their browser and urllib do.
    The variables are read on each request (a test or a long-lived agent may change them).
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or host in LOOPBACK or urllib.request.proxy_bypass(host):
        return POOL
    with _proxies_lock:
        manager = _proxies.get(proxy)
        if manager is None:
            manager = urllib3.ProxyManager(
                proxy, num_pools=16, maxsize=CONNECTIONS_PER_SERVER, block=False, retries=RETRIES
            )
            _proxies[proxy] = manager
        return manager


class PooledResponse:
    """One answer whose connection goes back to the pool once its body is read (or closes if it is not).

    Reads raise ``OSError`` for a connection that fails, as ``http.client``'s do, so callers catch one kind.
    """

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response
        self.status = response.status
        self.reason = response.reason or ""  # the status line's phrase ("Not Found"), for messages
        self.headers = response.headers

    def readinto(self, out: memoryview) -> int:
        try:
            return int(self._response.readinto(out[:READ_PIECE_BYTES]))
        except Urllib3Error as exc:
            raise OSError(str(exc)) from None

    def read(self, size: int = -1) -> bytes:
        try:
            return bytes(self._response.read(None if size < 0 else size))
        except Urllib3Error as exc:
            raise OSError(str(exc)) from None

    def close(self) -> None:
        """Give the connection back: as it is once the body was read, after reading a short rest, else closed."""
        remaining = self._response.length_remaining
        if remaining is not None and 0 < remaining <= DRAIN_LIMIT_BYTES:
            self._response.drain_conn()
        elif remaining != 0 and not self._response.closed:
            self._response.close()  # a long body nobody wants: a new connection costs less than reading it
        self._response.release_conn()

    def __enter__(self) -> PooledResponse:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def get(url: str, headers: dict[str, str], timeout: float) -> PooledResponse:
    """GET ``url`` on a kept connection; the answer's status is the caller's to judge, its body unread.

    Args:
        url: an http or https URL.
        headers: request headers besides the User-Agent.
        timeout: seconds for the connection and for each read, as urllib's ``timeout``.

    Raises:
        OSError: the server cannot be reached, or the connection fails before an answer.
    """
    return request("GET", url, headers=headers, timeout=timeout)


def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str],
    timeout: float,
    body: bytes | None = None,
    redirect: bool = True,
) -> PooledResponse:
    """Send one request on a kept connection; the answer's status is the caller's to judge, its body unread.

    A POST is never sent twice: urllib3 retries a failed read only for methods that are safe to repeat.

    Args:
        method: ``GET`` or ``POST``.
        url: an http or https URL.
        headers: request headers; a ``User-Agent`` among them replaces the agent's.
        timeout: seconds for the connection and for each read, as urllib's ``timeout``.
        body: the request body, already encoded.
        redirect: follow redirects; False returns a 3xx answer as it is (login reports it instead of
            sending its token wherever the Location points).

    Raises:
        OSError: the server cannot be reached, or the connection fails before an answer.
    """
    try:
        response = _manager_for(url).request(
            method,
            url,
            body=body,
            headers={"User-Agent": USER_AGENT, **headers},
            timeout=urllib3.Timeout(connect=timeout, read=timeout),
            preload_content=False,
            decode_content=False,
            redirect=redirect,
        )
    except Urllib3Error as exc:
        reason: Any = getattr(exc, "reason", None) or exc
        raise OSError(str(reason)) from None
    return PooledResponse(response)

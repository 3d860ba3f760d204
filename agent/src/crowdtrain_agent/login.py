"""Device-code login (RFC 8628) against a Crowdtrain site, and the saved token's whoami and logout."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from . import __version__, pooled_http

logger = logging.getLogger(__name__)

# HTTP goes through the agent's one client (pooled_http), redirects not followed. Nothing the site
# sends is ever executed, and its text is stripped of control characters before it reaches the
# terminal (printable()).

CLIENT_ID = "crowdtrain-agent"
GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
HTTP_TIMEOUT_S = 15.0
MAX_RESPONSE_BYTES = 64 * 1024
SLOW_DOWN_STEP_S = 5  # RFC 8628 §3.5
MAX_BACKOFF_S = 60.0  # between polls while the site cannot be reached
MAX_NAME = 100  # the site's limit on device names
TORCH_PROBE_S = 3.0  # login must stay quick: give up on GPU details after this long


class LoginError(Exception):
    """A login, whoami or logout that failed; the message says what happened and what to do."""


class SiteUnreachable(LoginError):
    """No HTTP answer at all: connection refused, DNS, timeout, TLS."""


class LoginDenied(LoginError):
    """The volunteer pressed Deny in the browser."""


class LoginExpired(LoginError):
    """Nobody approved the code before it expired."""


class TokenRejected(LoginError):
    """The site does not accept the saved token (revoked, or from another site)."""


@dataclass(frozen=True, kw_only=True)
class DeviceCode:
    """The site's answer to a device authorization request (RFC 8628 §3.2)."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str
    expires_in: int
    interval: int


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Who a device token belongs to, as the site tells it."""

    device_id: int
    device_name: str
    user: str
    server: str


@dataclass(frozen=True, kw_only=True)
class Issued:
    """A successful login: the new device's token (shown once) and who it belongs to."""

    token: str
    identity: Identity


# ------------------------------------------------------------------ HTTP


def printable(text: Any, limit: int = 200) -> str:
    """Text from the site, safe for a terminal: no escape sequences, no control characters, bounded."""
    return "".join(ch for ch in str(text) if ch.isprintable())[:limit]


def _call(url: str, *, form: dict[str, str] | None = None, token: str | None = None) -> tuple[int, dict[str, Any]]:
    """One JSON request: POST ``form`` (form-encoded, as RFC 8628 says) or GET; returns status and body.

    Raises:
        SiteUnreachable: no HTTP answer.
        LoginError: an answer that is not a JSON object, or a redirect.
    """
    data = urlencode(form).encode() if form is not None else None
    headers = {"Accept": "application/json", "User-Agent": f"crowdtrain-agent/{__version__}"}
    if data is not None:
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        # Redirects are reported, not followed: one would resend the bearer token to wherever the
        # Location points, and turn our POSTs into GETs; the volunteer fixes --server instead.
        with pooled_http.request(
            "POST" if data is not None else "GET",
            url,
            headers=headers,
            body=data,
            timeout=HTTP_TIMEOUT_S,
            redirect=False,
        ) as response:
            status, raw = response.status, response.read(MAX_RESPONSE_BYTES + 1)
    except OSError as exc:
        raise SiteUnreachable(f"cannot reach {url}: {printable(exc)}") from None
    if 300 <= status < 400:
        location = printable(response.headers.get("Location", "?"))
        raise LoginError(
            f"{url} redirects to {location}; pass the site's final address as --server "
            "(often https:// instead of http://)"
        )
    body: Any = None
    if len(raw) <= MAX_RESPONSE_BYTES:
        try:
            body = json.loads(raw)
        except ValueError:
            pass
    if not isinstance(body, dict):
        raise LoginError(
            f"{url} answered HTTP {status} with something that is not a JSON object; "
            "check that --server is the address of a Crowdtrain site"
        )
    return status, body


def _field(body: dict[str, Any], name: str, kind: type, url: str) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise LoginError(f"{url} answered without a valid {name!r}; the site may run another version")
    return value


def _site_error(body: dict[str, Any]) -> str:
    error = printable(body.get("error", "unknown error"), 60)
    description = printable(body.get("error_description", ""))
    return f"{error}: {description}" if description else error


def _identity(body: dict[str, Any], url: str) -> Identity:
    return Identity(
        device_id=_field(body, "device_id", int, url),
        device_name=printable(_field(body, "device_name", str, url), MAX_NAME),
        user=printable(_field(body, "user", str, url)),
        server=printable(body.get("server", "")),
    )


# ------------------------------------------------------------------ what we tell the site


def collect_hardware(*, probe_torch: bool = True, torch_timeout_s: float = TORCH_PROBE_S) -> dict[str, Any]:
    """What this machine is, cheaply: host, OS, CPUs, and the GPU if PyTorch answers within a few seconds.

    The volunteer sees it on the approval page, to recognise the machine
    asking. The real benchmark comes later, when ``run`` says hello.
    """
    info: dict[str, Any] = {
        "hostname": printable(socket.gethostname(), 200),
        "os": printable(f"{platform.system()} {platform.release()}".strip(), 200),
        "machine": printable(platform.machine(), 200),
        "cpu_count": os.cpu_count() or 0,
        "python": platform.python_version(),
        "agent_version": __version__,
    }
    if probe_torch:
        info.update(_torch_info(torch_timeout_s))
    return {key: value for key, value in info.items() if value not in ("", None)}


def _torch_info(timeout_s: float) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def probe() -> None:
        try:
            import torch
        except Exception:  # not installed, or a broken install: login works without it
            logger.debug("no torch to ask about the GPU", exc_info=True)
            return
        info: dict[str, Any] = {"torch_version": str(torch.__version__)}
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                info["accelerator"] = str(props.name)[:200]
                info["accelerator_memory_bytes"] = int(props.total_memory)
                info["accelerator_count"] = int(torch.cuda.device_count())
            elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
                info["accelerator"] = "Apple GPU (MPS)"
        except Exception:
            logger.debug("torch could not describe the GPU", exc_info=True)
        found.update(info)  # one update: the caller sees all of it or none

    # A daemon thread, so a slow CUDA start-up delays the login by TORCH_PROBE_S at most.
    thread = threading.Thread(target=probe, name="crowdtrain-torch-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.debug("torch took over %.1f s to answer; logging in without GPU details", timeout_s)
    return dict(found)


def default_device_name() -> str:
    return printable(socket.gethostname(), MAX_NAME).strip() or "my computer"


# ------------------------------------------------------------------ the flow


def request_code(server: str, name: str, hardware: dict[str, Any]) -> DeviceCode:
    """Ask the site for a device code and a user code (RFC 8628 §3.1).

    Raises:
        LoginError: the site refused or could not be reached.
    """
    url = f"{server}/api/device/code"
    status, body = _call(url, form={"client_id": CLIENT_ID, "name": name, "hardware": json.dumps(hardware)})
    if status != 200:
        raise LoginError(f"the site refused to start a login ({_site_error(body)})")
    expires_in = _field(body, "expires_in", int, url)
    interval = _field(body, "interval", int, url)
    code = DeviceCode(
        device_code=_field(body, "device_code", str, url),
        user_code=printable(_field(body, "user_code", str, url), 32),
        verification_uri=printable(_field(body, "verification_uri", str, url), 500),
        verification_uri_complete=printable(body.get("verification_uri_complete") or "", 500),
        expires_in=max(1, min(expires_in, 3600)),
        interval=max(1, min(interval, 60)),
    )
    if urlsplit(code.verification_uri).scheme not in ("http", "https"):
        raise LoginError(f"the site gave a verification address that is not http(s): {code.verification_uri}")
    return code


def poll_for_token(
    server: str,
    code: DeviceCode,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Issued:
    """Poll the token endpoint at the site's interval until the code is approved, denied or expired.

    Follows RFC 8628 §3.5: ``authorization_pending`` waits another interval,
    ``slow_down`` adds 5 s to it for good, and a site that cannot be reached
    is asked less and less often (the code may still be approved meanwhile).

    Raises:
        LoginDenied: the volunteer denied the device.
        LoginExpired: the code expired first.
        LoginError: any other refusal.
    """
    url = f"{server}/api/device/token"
    form = {"grant_type": GRANT_TYPE, "device_code": code.device_code, "client_id": CLIENT_ID}
    deadline = clock() + code.expires_in
    interval = float(code.interval)
    wait = interval
    while True:
        sleep(wait)
        try:
            status, body = _call(url, form=form)
        except SiteUnreachable as exc:
            if clock() >= deadline:  # the site can no longer say so itself
                raise LoginExpired(
                    f"code {code.user_code} expired while the site could not be reached ({exc})"
                ) from None
            wait = min(wait * 2, MAX_BACKOFF_S)
            logger.debug("%s; asking again in %.0f s", exc, wait)
            continue
        if status == 200:
            token = _field(body, "access_token", str, url)
            if not token or not token.isprintable() or len(token) > 512:
                raise LoginError(f"{url} answered with an unusable access_token")
            return Issued(token=token, identity=_identity({**body, "server": server}, url))
        error = body.get("error")
        if error == "authorization_pending":
            wait = interval
        elif error == "slow_down":
            interval += SLOW_DOWN_STEP_S
            wait = interval
            logger.debug("the site asked to slow down; polling every %.0f s", interval)
        elif error == "access_denied":
            raise LoginDenied(f"code {code.user_code} was denied in the browser")
        elif error == "expired_token":
            raise LoginExpired(f"code {code.user_code} expired before it was approved")
        else:
            raise LoginError(f"the site refused the login ({_site_error(body)})")


def can_open_browser() -> bool:
    """False where a browser would open on another screen or take over this terminal."""
    if os.environ.get("SSH_CONNECTION") or os.environ.get("SSH_TTY"):
        return False
    if sys.platform.startswith("linux") or "bsd" in sys.platform:
        # Without a display, webbrowser falls back to text browsers (lynx, w3m) in this terminal.
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def show_code(console: Console, code: DeviceCode) -> None:
    body = Text()
    body.append("To log this machine in, open\n\n    ")
    body.append(code.verification_uri, style="bold underline")
    body.append("\n\nand enter the code\n\n    ")
    body.append(code.user_code, style="bold reverse")
    body.append(f"\n\nThe code expires in {max(1, code.expires_in // 60)} minutes.")
    console.print(Panel(body, title="crowdtrain-agent login", border_style="cyan", expand=False))
    if code.verification_uri_complete:
        link = Text("Or open this link, with the code filled in: ")
        link.append(code.verification_uri_complete, style="underline")
        console.print(link, soft_wrap=True)  # unwrapped, so the terminal can make it one clickable link


def login(
    server: str,
    *,
    name: str,
    open_browser: bool,
    console: Console,
    hardware: dict[str, Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Issued:
    """The whole device-code login: get a code, show it, open the browser, wait for approval.

    Args:
        server: the site's base URL, without a trailing slash.
        name: the device name to propose; the volunteer may change it.
        open_browser: try to open the verification page (still skipped without a display).
        console: where the code and progress go.
        hardware: what to report about this machine (collect_hardware() when None).
        sleep: replaceable in tests.

    Returns:
        The new device's token and identity; the caller saves it.

    Raises:
        LoginError: and its subclasses, with a message for the volunteer.
    """
    hardware = collect_hardware() if hardware is None else hardware
    code = request_code(server, name, hardware)
    show_code(console, code)
    target = code.verification_uri_complete or code.verification_uri
    if urlsplit(target).scheme not in ("http", "https"):
        target = code.verification_uri
    if open_browser and can_open_browser():
        try:
            opened = webbrowser.open(target, new=2)
        except webbrowser.Error:
            opened = False
        if opened:
            console.print("Opened your browser; if nothing appeared, open the address above yourself.")
    with console.status("Waiting for you to approve the code in the browser (Ctrl-C to cancel)…"):
        return poll_for_token(server, code, sleep=sleep)


def whoami(server: str, token: str) -> Identity:
    """Ask the site whom ``token`` belongs to.

    Raises:
        TokenRejected: the site does not accept the token.
        LoginError: the site could not be reached or answered nonsense.
    """
    url = f"{server}/api/me"
    status, body = _call(url, token=token)
    if status == 401:
        raise TokenRejected(f"{server} does not accept this device's token ({_site_error(body)})")
    if status != 200:
        raise LoginError(f"{url} answered HTTP {status} ({_site_error(body)})")
    return _identity({**body, "server": body.get("server") or server}, url)


def revoke(server: str, token: str) -> bool:
    """Ask the site to revoke ``token``; False if it did not know it (revoked already).

    Raises:
        SiteUnreachable: the site could not be reached.
        LoginError: any other failure.
    """
    url = f"{server}/api/device/revoke"
    status, body = _call(url, form={}, token=token)
    if status == 401:
        return False
    if status != 200:
        raise LoginError(f"{url} answered HTTP {status} ({_site_error(body)})")
    return True

"""The aggregator's frozen configuration: CLI flags, then CROWDTRAIN_BACKBONE_* variables, then defaults."""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .spool import DEFAULT_MIN_BYTES

if TYPE_CHECKING:
    from .checkpoints import CheckpointStore

logger = logging.getLogger(__name__)

ENV_PREFIX = "CROWDTRAIN_BACKBONE_"

DEFAULT_SITE = "http://127.0.0.1:8000"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_CHECKPOINT_DIR = "var/checkpoints"
DEFAULT_FALLBACK_DIR = "var/checkpoints-fallback"
# Pending gradient slices are kept as fp32 until their step commits; this caps
# what a burst of uploads (or a hostile agent) can make the process hold.
DEFAULT_MAX_PENDING_BYTES = 2 << 30
# Large pending gradients wait in files here, mapped in only while read (``spool``): a folder on a disk.
DEFAULT_SPOOL_DIR = "var/spool"
# An upload socket must send its first upload header this soon after connecting: agents send it
# at once, and a socket that only connects must not hold a connection for ever.
DEFAULT_HEADER_TIMEOUT_S = 5.0
# The port's HTTP server (aiohttp) logs what it cannot answer through this logger: requests
# it cannot parse, handlers that raised. __main__ keeps it at WARNING.
WS_LOGGER_NAME = "crowdtrain_backbone.websockets"


class ConfigError(ValueError):
    """A flag or environment variable the aggregator cannot start with; the message names it."""


@dataclass(frozen=True, kw_only=True)
class BackboneConfig:
    """Everything the aggregator reads from its command line and environment, read once at start.

    ``public_host`` is the host agents use to reach this process; it goes into
    the upload and params URLs the site hands out, so it must be reachable
    from volunteers' machines when ``host`` is a wildcard address.
    """

    site: str
    token: str
    name: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    checkpoint_dir: Path = Path(DEFAULT_CHECKPOINT_DIR)
    # s3://bucket/prefix: checkpoints in a bucket (credentials from the site's CROWDTRAIN_S3_* variables)
    # instead of checkpoint_dir, so a replacement aggregator on another machine restores them.
    checkpoint_url: str = ""
    # Where a checkpoint goes when the store refuses it (storage down, disk full), so this process can
    # resume from it after a restart on the same machine; retried in the store meanwhile. None: no fallback
    # (the default for a checkpoint folder, whose fallback would share its disk).
    checkpoint_fallback_dir: Path | None = None
    public_host: str = DEFAULT_HOST
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    spool_dir: Path = Path(DEFAULT_SPOOL_DIR)
    spool_min_bytes: int = DEFAULT_MIN_BYTES  # uploads below this stay in memory; 0: every upload to the spool
    # One intra-op thread by default: an aggregator's work is elementwise passes over its slice,
    # interleaved with socket I/O, and OpenMP workers that spin between such small ops cost more
    # than they give on a shared machine (docs/performance.md, "One torch thread"). Raise it on a
    # dedicated host with large slices.
    torch_threads: int = 1
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Set: /metrics wants Authorization: Bearer <token>. Empty: it answers loopback and private addresses only.
    metrics_token: str = ""

    def checkpoint_store(self, environ: Mapping[str, str]) -> CheckpointStore:
        """The bucket of ``checkpoint_url`` if set, else the folder ``checkpoint_dir``."""
        from .checkpoints import LocalStore, S3Store  # torch: only once the config is known to be good

        if self.checkpoint_url:
            return S3Store.from_url(self.checkpoint_url, environ)
        return LocalStore(self.checkpoint_dir)

    @property
    def backbone_ws_url(self) -> str:
        """The site's ``/ws/backbone/`` endpoint, with the scheme switched from http(s) to ws(s)."""
        scheme = "wss" if self.site.startswith("https://") else "ws"
        return f"{scheme}://{self.site.split('://', 1)[1].rstrip('/')}/ws/backbone/"


def _source(name: str, flag: str, flags: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The raw value and where it came from (for error messages), flags first."""
    value = flags.get(name)
    if value is not None:
        return str(value), f"--{flag}"
    env_name = ENV_PREFIX + name.upper()
    if env_name in environ:
        return environ[env_name], env_name
    return None, ""


def _parse_site(raw: str, where: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}={raw!r} is not a site URL; give the site's base URL, e.g. {DEFAULT_SITE}")
    return raw.rstrip("/")


def _parse_port(raw: str, where: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where}={raw!r} is not a TCP port; use an integer 0-65535 (0 picks a free port)")
    return port


def _parse_bytes(raw: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{where}={raw!r} must be a positive number of bytes, e.g. {DEFAULT_MAX_PENDING_BYTES}")
    return value


def _parse_byte_count(raw: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{where}={raw!r} must be a number of bytes, 0 or more, e.g. {DEFAULT_MIN_BYTES}")
    return value


def _parse_threads(raw: str, where: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 256:
        raise ConfigError(f"{where}={raw!r} must be a number of threads from 1 to 256")
    return value


def _parse_seconds(raw: str, where: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}={raw!r} must be a positive number of seconds, e.g. {DEFAULT_HEADER_TIMEOUT_S:g}")
    return value


def _parse_path(raw: str, where: str) -> Path:
    if not raw.strip():
        raise ConfigError(f"{where}={raw!r} must name a folder, e.g. {DEFAULT_CHECKPOINT_DIR}")
    return Path(raw)


def _parse_optional_path(raw: str, where: str) -> Path | None:
    return Path(raw) if raw.strip() else None  # set but empty: no fallback


def _parse_bucket_url(raw: str, where: str) -> str:
    if not raw.strip():
        return ""  # set but empty (compose passes unset variables so): the checkpoint folder then
    bucket = raw.removeprefix("s3://").partition("/")[0]
    if not raw.startswith("s3://") or not bucket:
        raise ConfigError(f"{where}={raw!r} must be an S3 location like s3://BUCKET/checkpoints")
    return raw


def _parse_text(raw: str, where: str) -> str:
    if not raw.strip() or any(c.isspace() for c in raw):
        raise ConfigError(f"{where}={raw!r} must be a non-empty string without spaces")
    return raw


def _parse_optional_text(raw: str, where: str) -> str:
    if not raw:
        return ""  # set but empty (compose passes unset variables so): none
    return _parse_text(raw, where)


def load_config(flags: Mapping[str, Any], environ: Mapping[str, str]) -> BackboneConfig:
    """Build the config from parsed CLI flags (None = not given), then the environment, then defaults.

    Args:
        flags: argparse values keyed by field name (``site``, ``token``, ``checkpoint_dir``, ...).
        environ: usually ``os.environ``; passed in so tests need not patch the process.

    Returns:
        The frozen config.

    Raises:
        ConfigError: naming the flag or variable, its value, and what would be accepted.
    """

    def get(name: str, parse: Callable[[str, str], Any], default: Any) -> Any:
        raw, where = _source(name, name.replace("_", "-"), flags, environ)
        return default if raw is None else parse(raw, where)

    token = get("token", _parse_text, None)
    if token is None:
        raise ConfigError(
            f"no backbone token: pass --token or set {ENV_PREFIX}TOKEN to the token the site's admin issued "
            "for aggregators"
        )
    host = get("host", _parse_text, DEFAULT_HOST)
    # A wildcard bind address is no address an agent can dial: advertise the hostname instead.
    default_public = socket.getfqdn() if host in ("0.0.0.0", "::") else host
    checkpoint_url = get("checkpoint_url", _parse_bucket_url, "")
    return BackboneConfig(
        site=get("site", _parse_site, DEFAULT_SITE),
        token=token,
        name=get("name", _parse_text, f"agg-{socket.gethostname()}"),
        host=host,
        port=get("port", _parse_port, DEFAULT_PORT),
        checkpoint_dir=get("checkpoint_dir", _parse_path, Path(DEFAULT_CHECKPOINT_DIR)),
        checkpoint_url=checkpoint_url,
        checkpoint_fallback_dir=get(
            "checkpoint_fallback_dir",
            _parse_optional_path,
            Path(DEFAULT_FALLBACK_DIR) if checkpoint_url else None,
        ),
        public_host=get("public_host", _parse_text, default_public),
        max_pending_bytes=get("max_pending_bytes", _parse_bytes, DEFAULT_MAX_PENDING_BYTES),
        spool_dir=get("spool_dir", _parse_path, Path(DEFAULT_SPOOL_DIR)),
        spool_min_bytes=get("spool_min_bytes", _parse_byte_count, DEFAULT_MIN_BYTES),
        torch_threads=get("torch_threads", _parse_threads, 1),
        header_timeout_s=get("header_timeout_s", _parse_seconds, DEFAULT_HEADER_TIMEOUT_S),
        metrics_token=get("metrics_token", _parse_optional_text, ""),
    )

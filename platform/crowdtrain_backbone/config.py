"""The aggregator's frozen configuration: CLI flags, then CROWDTRAIN_BACKBONE_* variables, then defaults."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from crowdtrain_agent.settings_loader import ASSIGNED, Setting, SettingError, load

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


def _site_url(raw: object) -> str:
    raw = str(raw)
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("not a site URL")
    return raw.rstrip("/")


def _folder(raw: object) -> Path:
    raw = str(raw)
    if not raw.strip():
        raise ValueError("no folder")
    return Path(raw)


def _bucket_url(raw: object) -> str:
    raw = str(raw)
    if not raw.strip():
        return ""  # set but empty (compose passes unset variables so): the checkpoint folder then
    if not raw.startswith("s3://") or not raw.removeprefix("s3://").partition("/")[0]:
        raise ValueError("not an S3 location")
    return raw


def _word(raw: object) -> str:
    raw = str(raw)
    if not raw.strip() or any(c.isspace() for c in raw):
        raise ValueError("not one word")
    return raw


_WORD = "must be a non-empty string without spaces"
_FOLDER = f"must name a folder, e.g. {DEFAULT_CHECKPOINT_DIR}"
_BYTES = f"must be a positive number of bytes, e.g. {DEFAULT_MAX_PENDING_BYTES}"
_BYTE_COUNT = f"must be a number of bytes, 0 or more, e.g. {DEFAULT_MIN_BYTES}"
_SECONDS = f"must be a positive number of seconds, e.g. {DEFAULT_HEADER_TIMEOUT_S:g}"
# In this order, so a bad value is reported as before: the token first, the metrics token last. A
# default of None follows other settings (load_config).
SETTINGS = (
    Setting("token", str, None, _WORD, flag="--token", env=ENV_PREFIX + "TOKEN", check=_word,
            secret=True),
    Setting("host", str, DEFAULT_HOST, _WORD, flag="--host", env=ENV_PREFIX + "HOST", check=_word),
    Setting("checkpoint_url", str, "", "must be an S3 location like s3://BUCKET/checkpoints",
            flag="--checkpoint-url", env=ENV_PREFIX + "CHECKPOINT_URL", check=_bucket_url),
    Setting("site", str, DEFAULT_SITE, f"is not a site URL; give the site's base URL, e.g. {DEFAULT_SITE}",
            flag="--site", env=ENV_PREFIX + "SITE", check=_site_url),
    Setting("name", str, None, _WORD, flag="--name", env=ENV_PREFIX + "NAME", check=_word),
    Setting("port", int, DEFAULT_PORT, "is not a TCP port; use an integer 0-65535 (0 picks a free port)",
            flag="--port", env=ENV_PREFIX + "PORT", ge=0, le=65535),
    Setting("checkpoint_dir", Path, Path(DEFAULT_CHECKPOINT_DIR), _FOLDER, flag="--checkpoint-dir",
            env=ENV_PREFIX + "CHECKPOINT_DIR", check=_folder),
    # Set but empty: no fallback folder.
    Setting("checkpoint_fallback_dir", Path | None, None, flag="--checkpoint-fallback-dir",
            env=ENV_PREFIX + "CHECKPOINT_FALLBACK_DIR", check=lambda raw: Path(raw) if str(raw).strip() else None),
    Setting("public_host", str, None, _WORD, flag="--public-host", env=ENV_PREFIX + "PUBLIC_HOST", check=_word),
    Setting("max_pending_bytes", int, DEFAULT_MAX_PENDING_BYTES, _BYTES, flag="--max-pending-bytes",
            env=ENV_PREFIX + "MAX_PENDING_BYTES", gt=0),
    Setting("spool_dir", Path, Path(DEFAULT_SPOOL_DIR), _FOLDER, flag="--spool-dir", env=ENV_PREFIX + "SPOOL_DIR",
            check=_folder),
    Setting("spool_min_bytes", int, DEFAULT_MIN_BYTES, _BYTE_COUNT, flag="--spool-min-bytes",
            env=ENV_PREFIX + "SPOOL_MIN_BYTES", ge=0),
    Setting("torch_threads", int, 1, "must be a number of threads from 1 to 256", flag="--torch-threads",
            env=ENV_PREFIX + "TORCH_THREADS", ge=1, le=256),
    Setting("header_timeout_s", float, DEFAULT_HEADER_TIMEOUT_S, _SECONDS, flag="--header-timeout-s",
            env=ENV_PREFIX + "HEADER_TIMEOUT_S", gt=0, finite=True),
    # Set but empty (compose passes unset variables so): none.
    Setting("metrics_token", str, "", _WORD, flag="--metrics-token", env=ENV_PREFIX + "METRICS_TOKEN",
            check=lambda raw: _word(raw) if raw else "", secret=True),
)  # fmt: skip


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
    if flags.get("token") is None and ENV_PREFIX + "TOKEN" not in environ:
        raise ConfigError(
            f"no backbone token: pass --token or set {ENV_PREFIX}TOKEN to the token the site's admin issued "
            "for aggregators"
        )
    try:
        loaded = load(SETTINGS, flags=flags, environ=environ, message=ASSIGNED)
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    values = loaded.values
    # Defaults that follow other settings. A wildcard bind address is no address an agent can dial:
    # advertise the hostname instead.
    if values["name"] is None:
        values["name"] = f"agg-{socket.gethostname()}"
    if values["public_host"] is None:
        values["public_host"] = socket.getfqdn() if values["host"] in ("0.0.0.0", "::") else values["host"]
    if "checkpoint_fallback_dir" not in loaded.origins and values["checkpoint_url"]:
        values["checkpoint_fallback_dir"] = Path(DEFAULT_FALLBACK_DIR)
    return BackboneConfig(**values)

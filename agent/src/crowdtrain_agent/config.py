"""The agent's configuration: CLI flags, then CROWDTRAIN_AGENT_* variables, then the config file, then defaults."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import platformdirs

from .controls import ControlError, Controls, parse_schedule

logger = logging.getLogger(__name__)

APP_NAME = "crowdtrain"
ENV_PREFIX = "CROWDTRAIN_AGENT_"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
# A fresh checkout runs the site on this address (`./manage.py runserver`).
DEFAULT_SERVER = "http://127.0.0.1:8000"


class ConfigError(ValueError):
    """A configuration value the agent cannot start with; the message names where it came from."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything the agent needs to run, read once at start-up."""

    server: str  # http(s) base URL of the site, without a trailing slash
    token: str  # the device's API token, sent as `Authorization: Bearer ...`
    device: str = "auto"  # auto | cpu | cuda | mps
    threads: int | None = None  # torch.set_num_threads; None keeps torch's default
    campaign_id: int | None = None  # None: any running campaign
    cache_dir: Path = Path(platformdirs.user_cache_dir(APP_NAME))
    max_leases: int | None = None  # stop after this many leases (tests, benchmarks)
    progress: bool = True  # rich live panel; False logs plain lines
    # The volunteer's controls (``controls``, ``ratelimit``): when it may work, and what it may use.
    controls: Controls = field(default_factory=Controls)
    gpus: tuple[int, ...] = ()  # CUDA devices by index it may use (none: all); it computes on the first
    gpu_memory_gb: float | None = None  # at most this much of the GPU's memory
    upload_kbps: float | None = None
    download_kbps: float | None = None
    # The controls set here (flag, variable or file): they win over those set on the site's My devices page.
    local_controls: frozenset[str] = frozenset()

    @property
    def control_url(self) -> str:
        """The control channel's WebSocket URL, derived from the site's HTTP address."""
        scheme, rest = self.server.split("://", 1)
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/ws/agent/"

    @property
    def shards_url(self) -> str:
        """URL prefix of the site's shard endpoint; ``/<sha256>`` is appended."""
        return f"{self.server}/api/shards"


def default_config_path() -> Path:
    """Where `crowdtrain-agent login` keeps the server address and token.

    ``CROWDTRAIN_AGENT_CONFIG`` names another file (several logins on one
    machine, tests); otherwise the user config folder of platformdirs.
    """
    override = os.environ.get(ENV_PREFIX + "CONFIG", "").strip()
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.json"


def read_config_file(path: Path) -> dict[str, str]:
    """Read the saved login (``server``, ``token``); a missing file is an empty login.

    Raises:
        ConfigError: if the file exists but is not a JSON object of strings.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(
            f"cannot read the agent config file {path}: {exc}; fix its permissions or delete it"
        ) from None
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"the agent config file {path} is not a JSON object of strings; delete it and log in again")
    return {k: v for k, v in data.items() if k in ("server", "token")}


def write_config_file(path: Path, *, server: str, token: str) -> None:
    """Save the login so later runs need no flags; readable by its owner only (mode 0600).

    The file is created with mode 0600 before the token is written, so the
    token is never readable by other users, not even for an instant.
    """
    _write_private(path, {"server": _check_server("server", server), "token": token})


def forget_token(path: Path) -> bool:
    """Delete the saved token, keeping the server address as the default for the next login.

    Returns:
        True if there was a token to delete.

    Raises:
        ConfigError: if the file exists but is damaged or unreadable.
    """
    saved = read_config_file(path)
    if "token" not in saved:
        return False
    if saved.get("server"):
        _write_private(path, {"server": saved["server"]})
    else:
        path.unlink()
    return True


def _write_private(path: Path, data: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply if the file already existed
        json.dump(data, fh)
    os.replace(tmp, path)


def login_server(flag: str | None, env: Mapping[str, str] | None = None, config_path: Path | None = None) -> str:
    """The site ``crowdtrain-agent login`` talks to.

    The first of: --server, CROWDTRAIN_AGENT_SERVER, the saved login, the default.

    Raises:
        ConfigError: naming the flag or variable and the bad address.
    """
    env = os.environ if env is None else env
    if flag:
        return _check_server("--server", flag)
    if env.get(ENV_PREFIX + "SERVER"):
        return _check_server(ENV_PREFIX + "SERVER", env[ENV_PREFIX + "SERVER"])
    path = default_config_path() if config_path is None else config_path
    saved = read_config_file(path).get("server")
    return _check_server(f"server in {path}", saved) if saved else DEFAULT_SERVER


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> AgentConfig:
    """Build the config from flags, then environment, then the config file, then defaults.

    Args:
        flags: parsed CLI flags by field name; None means "not given".
        env: the environment (os.environ when None).
        config_path: the saved login file (default_config_path() when None).

    Returns:
        A validated, frozen AgentConfig.

    Raises:
        ConfigError: naming the flag or variable, the bad value and what is accepted.
    """
    env = os.environ if env is None else env
    saved = read_config_file(default_config_path() if config_path is None else config_path)

    def pick(field: str, flag: str, var: str) -> tuple[str, Any] | None:
        """The first source that sets ``field``, with a name a person can look up."""
        if flags.get(field) is not None:
            return flag, flags[field]
        if env.get(ENV_PREFIX + var):
            return ENV_PREFIX + var, env[ENV_PREFIX + var]
        return None

    server_src = pick("server", "--server", "SERVER")
    if server_src is not None:
        server = _check_server(*server_src)
    elif saved.get("server"):
        server = _check_server(f"server in {config_path or default_config_path()}", saved["server"])
    else:
        server = DEFAULT_SERVER

    token_src = pick("token", "--token", "TOKEN")
    token = str(token_src[1]).strip() if token_src else ""
    # The saved token belongs to the saved server; never send it to another one.
    if not token and saved.get("token") and saved.get("server", "").rstrip("/") == server:
        token = saved["token"]
    if not token:
        raise ConfigError(
            f"no API token for {server}: run `crowdtrain-agent login --server {server}` once, "
            f"or pass --token TOKEN or set {ENV_PREFIX}TOKEN"
        )

    device_src = pick("device", "--device", "DEVICE")
    device = "auto"
    if device_src is not None:
        device = str(device_src[1]).strip().lower()
        if device not in DEVICE_CHOICES:
            raise ConfigError(f"{device_src[0]} must be one of {', '.join(DEVICE_CHOICES)}, got {device_src[1]!r}")

    threads_src = pick("threads", "--threads", "THREADS")
    campaign_src = pick("campaign_id", "--campaign", "CAMPAIGN")
    cache_src = pick("cache_dir", "--cache-dir", "CACHE_DIR")
    max_leases_src = ("--max-leases", flags["max_leases"]) if flags.get("max_leases") is not None else None

    return AgentConfig(
        server=server,
        token=token,
        device=device,
        threads=_positive_int(*threads_src) if threads_src else None,
        campaign_id=_positive_int(*campaign_src) if campaign_src else None,
        cache_dir=Path(cache_src[1]).expanduser() if cache_src else Path(platformdirs.user_cache_dir(APP_NAME)),
        max_leases=_positive_int(*max_leases_src) if max_leases_src else None,
        progress=bool(flags.get("progress", True)),
        **read_controls(flags, env, controls_path(flags, env)),
    )


# The volunteer's controls: (field, flag, environment variable suffix, key in the controls file).
CONTROL_SOURCES = (
    ("idle_minutes", "--idle-minutes", "IDLE_MINUTES", "idle_minutes"),
    ("max_other_cpu", "--max-other-cpu", "MAX_OTHER_CPU", "max_other_cpu_percent"),
    ("schedule", "--schedule", "SCHEDULE", "schedule"),
    ("pause_on_battery", "--pause-on-battery", "PAUSE_ON_BATTERY", "pause_on_battery"),
    ("gpus", "--gpus", "GPUS", "gpus"),
    ("gpu_memory_gb", "--gpu-memory-gb", "GPU_MEMORY_GB", "gpu_memory_gb"),
    ("upload_kbps", "--upload-kbps", "UPLOAD_KBPS", "upload_kbps"),
    ("download_kbps", "--download-kbps", "DOWNLOAD_KBPS", "download_kbps"),
)


def controls_path(flags: Mapping[str, Any], env: Mapping[str, str]) -> Path:
    """The controls file: --controls, CROWDTRAIN_AGENT_CONTROLS, or controls.json beside the login file."""
    chosen = flags.get("controls_file") or env.get(ENV_PREFIX + "CONTROLS", "").strip()
    return Path(chosen).expanduser() if chosen else default_config_path().with_name("controls.json")


def read_controls(flags: Mapping[str, Any], env: Mapping[str, str], path: Path) -> dict[str, Any]:
    """The controls' AgentConfig fields: each from its flag, else its variable, else the controls file.

    Raises:
        ConfigError: naming the flag, variable or file key and what it accepts.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        saved: dict[str, Any] = {}
    except OSError as exc:
        raise ConfigError(f"cannot read the controls file {path}: {exc}") from None
    else:
        try:
            saved = json.loads(text)
        except ValueError:
            saved = None  # type: ignore[assignment]
        if not isinstance(saved, dict):
            raise ConfigError(f"the controls file {path} is not a JSON object; see crowdtrain-agent run --help")
        unknown = sorted(set(saved) - {key for *_, key in CONTROL_SOURCES})
        if unknown:
            known = ", ".join(key for *_, key in CONTROL_SOURCES)
            raise ConfigError(f"the controls file {path} has unknown keys {unknown}; it may hold {known}")
    values: dict[str, tuple[str, Any]] = {}
    for field_name, flag, var, key in CONTROL_SOURCES:
        if flags.get(field_name) not in (None, False):
            values[field_name] = (flag, flags[field_name])
        elif env.get(ENV_PREFIX + var):
            values[field_name] = (ENV_PREFIX + var, env[ENV_PREFIX + var])
        elif key in saved:
            values[field_name] = (f"{key} in {path}", saved[key])
    try:
        controls = Controls(
            idle_after_min=_number(*values["idle_minutes"], low=0, high=1440) if "idle_minutes" in values else None,
            max_other_cpu=_number(*values["max_other_cpu"], low=1, high=100) / 100
            if "max_other_cpu" in values
            else None,
            schedule=parse_schedule(str(values["schedule"][1])) if "schedule" in values else (),
            pause_on_battery=_flag(*values["pause_on_battery"]) if "pause_on_battery" in values else False,
        )
    except ControlError as exc:
        raise ConfigError(str(exc)) from None
    return {
        "controls": controls,
        "gpus": _indices(*values["gpus"]) if "gpus" in values else (),
        "gpu_memory_gb": _number(*values["gpu_memory_gb"], low=0.1, high=4096) if "gpu_memory_gb" in values else None,
        "upload_kbps": _number(*values["upload_kbps"], low=8, high=1e8) if "upload_kbps" in values else None,
        "download_kbps": _number(*values["download_kbps"], low=8, high=1e8) if "download_kbps" in values else None,
        "local_controls": frozenset(values),
    }


def _number(name: str, value: Any, *, low: float, high: float) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        number = math.nan
    if not low <= number <= high:
        raise ConfigError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")
    return number


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _indices(name: str, value: Any) -> tuple[int, ...]:
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= 3 for p in parts):
        raise ConfigError(f"{name} must be GPU indices separated by commas, like 0 or 0,1, got {value!r}")
    return tuple(dict.fromkeys(int(p) for p in parts))


def _check_server(name: str, value: Any) -> str:
    url = str(value).strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"{name} must be the site's http:// or https:// address, like {DEFAULT_SERVER}, got {value!r}"
        )
    return url


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number

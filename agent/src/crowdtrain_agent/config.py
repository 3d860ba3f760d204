"""The agent's configuration: CLI flags, then CROWDTRAIN_AGENT_* variables, then the config file, then defaults."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import platformdirs

from .controls import ControlError, Controls, Window, parse_schedule
from .settings_loader import Setting, SettingError, load, parse

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


def _server(value: object) -> str:
    url = str(value).strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError("not a site address")
    return url


def _device(value: object) -> str:
    device = str(value).strip().lower()
    if device not in DEVICE_CHOICES:
        raise ValueError("not a device")
    return device


def _on_off(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("neither true nor false")


def _indices(value: object) -> tuple[int, ...]:
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= 3 for p in parts):
        raise ValueError("not GPU indices")
    return tuple(dict.fromkeys(int(p) for p in parts))


def _schedule(value: object) -> tuple[Window, ...]:
    try:
        return parse_schedule(str(value))
    except ControlError as exc:
        raise ValueError(f"cannot be read: {exc}") from None  # its words say how to write the part it could not read


_POSITIVE = "must be a positive integer"
_SERVER = f"must be the site's http:// or https:// address, like {DEFAULT_SERVER}"
# Read first, so a missing token is reported before the other settings are checked.
LOGIN_SETTINGS = (
    Setting("server", str, DEFAULT_SERVER, _SERVER, flag="--server", env=ENV_PREFIX + "SERVER", key="server",
            check=_server),
    Setting("token", str, "", flag="--token", env=ENV_PREFIX + "TOKEN", check=lambda value: str(value).strip(),
            secret=True),
)  # fmt: skip
RUN_SETTINGS = (
    Setting("device", str, "auto", f"must be one of {', '.join(DEVICE_CHOICES)}", flag="--device",
            env=ENV_PREFIX + "DEVICE", check=_device),
    Setting("threads", int, None, _POSITIVE, flag="--threads", env=ENV_PREFIX + "THREADS", ge=1),
    Setting("campaign_id", int, None, _POSITIVE, flag="--campaign", env=ENV_PREFIX + "CAMPAIGN", ge=1),
    Setting("cache_dir", Path, None, flag="--cache-dir", env=ENV_PREFIX + "CACHE_DIR",
            check=lambda value: Path(str(value)).expanduser()),
    Setting("max_leases", int, None, _POSITIVE, flag="--max-leases", ge=1),
)  # fmt: skip
# The volunteer's controls: each a flag, a variable and a key in the controls file.
CONTROL_SETTINGS = (
    Setting("idle_minutes", float, None, "must be a number from 0 to 1440", flag="--idle-minutes",
            env=ENV_PREFIX + "IDLE_MINUTES", key="idle_minutes", ge=0, le=1440, finite=True),
    Setting("max_other_cpu", float, None, "must be a number from 1 to 100", flag="--max-other-cpu",
            env=ENV_PREFIX + "MAX_OTHER_CPU", key="max_other_cpu_percent", ge=1, le=100, finite=True),
    Setting("schedule", tuple, (), flag="--schedule", env=ENV_PREFIX + "SCHEDULE", key="schedule",
            check=_schedule),
    Setting("pause_on_battery", bool, False, "must be true or false", flag="--pause-on-battery",
            env=ENV_PREFIX + "PAUSE_ON_BATTERY", key="pause_on_battery", check=_on_off),
    Setting("gpus", tuple, (), "must be GPU indices separated by commas, like 0 or 0,1", flag="--gpus",
            env=ENV_PREFIX + "GPUS", key="gpus", check=_indices),
    Setting("gpu_memory_gb", float, None, "must be a number from 0.1 to 4096", flag="--gpu-memory-gb",
            env=ENV_PREFIX + "GPU_MEMORY_GB", key="gpu_memory_gb", ge=0.1, le=4096, finite=True),
    Setting("upload_kbps", float, None, "must be a number from 8 to 1e+08", flag="--upload-kbps",
            env=ENV_PREFIX + "UPLOAD_KBPS", key="upload_kbps", ge=8, le=1e8, finite=True),
    Setting("download_kbps", float, None, "must be a number from 8 to 1e+08", flag="--download-kbps",
            env=ENV_PREFIX + "DOWNLOAD_KBPS", key="download_kbps", ge=8, le=1e8, finite=True),
)  # fmt: skip


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
    path = default_config_path() if config_path is None else config_path
    saved = read_config_file(path)
    try:
        # An empty saved server is no server: the default then.
        login = _load(LOGIN_SETTINGS, flags, env, (str(path), {k: v for k, v in saved.items() if v}))
        server, token = login["server"], login["token"]
        # The saved token belongs to the saved server; never send it to another one.
        if not token and saved.get("token") and saved.get("server", "").rstrip("/") == server:
            token = saved["token"]
        if not token:
            raise ConfigError(
                f"no API token for {server}: run `crowdtrain-agent login --server {server}` once, "
                f"or pass --token TOKEN or set {ENV_PREFIX}TOKEN"
            )
        run = _load(RUN_SETTINGS, flags, env)
    except SettingError as exc:
        raise ConfigError(str(exc)) from None
    return AgentConfig(
        server=server,
        token=token,
        device=run["device"],
        threads=run["threads"],
        campaign_id=run["campaign_id"],
        cache_dir=run["cache_dir"] or Path(platformdirs.user_cache_dir(APP_NAME)),
        max_leases=run["max_leases"],
        progress=bool(flags.get("progress", True)),
        **read_controls(flags, env, controls_path(flags, env)),
    )


def _load(
    settings: tuple[Setting, ...],
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    *files: tuple[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The agent's way of reading: a variable set to "" counts as unset."""
    return load(settings, flags=flags, environ=env, files=files, ignore_empty=True).values


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
        keys = [str(setting.key) for setting in CONTROL_SETTINGS]
        unknown = sorted(set(saved) - set(keys))
        if unknown:
            raise ConfigError(f"the controls file {path} has unknown keys {unknown}; it may hold {', '.join(keys)}")
    try:
        loaded = load(CONTROL_SETTINGS, flags=flags, environ=env, files=[(str(path), saved)], ignore_empty=True)
        values = loaded.values
        controls = Controls(
            idle_after_min=values["idle_minutes"],
            max_other_cpu=None if values["max_other_cpu"] is None else values["max_other_cpu"] / 100,
            schedule=values["schedule"],
            pause_on_battery=values["pause_on_battery"],
        )
    except (SettingError, ControlError) as exc:
        raise ConfigError(str(exc)) from None
    return {
        "controls": controls,
        "gpus": values["gpus"],
        "gpu_memory_gb": values["gpu_memory_gb"],
        "upload_kbps": values["upload_kbps"],
        "download_kbps": values["download_kbps"],
        "local_controls": frozenset(loaded.origins),
    }


def _check_server(name: str, value: Any) -> str:
    try:
        return str(parse(LOGIN_SETTINGS[0], name, value))
    except SettingError as exc:
        raise ConfigError(str(exc)) from None

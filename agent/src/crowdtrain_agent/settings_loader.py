"""The one settings loader of the three programs: a flag, then a variable, then a file, then the default.

It lives in the agent because the agent is the one program installed alone: the site and the
aggregator depend on it, never the other way. pydantic-settings reads the variables and pydantic
checks the types and bounds; the messages are ours, because each must name the flag, variable or
file the value came from, the value, and what would be accepted, which pydantic's do not.
pydantic is imported on the first load, not with this module: ``crowdtrain-agent --version``
and ``login`` never pay for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

# The message of a bad value. ``where`` is "--flag", the variable's name or "key in FILE".
PLAIN = "{where} {accepts}, got {raw!r}"
ASSIGNED = "{where}={raw!r} {accepts}"


class SettingError(ValueError):
    """A value a program cannot start with; the message names where it came from, the value and what is accepted."""


@dataclass(frozen=True)
class Setting:
    """One value a program reads, where it may come from, and what it accepts.

    pydantic checks the raw text (or a flag's or file's value) as ``type`` within the bounds
    ``ge``, ``gt`` and ``le`` (and finite if ``finite``), after ``check``, if given, has turned it into that type (for
    formats pydantic has no type for: a site URL, GPU indices); ``check`` raises ValueError on a
    bad value. ``accepts`` finishes the message of a bad value ("must be a positive integer");
    None takes the ValueError's own text, for checks that tell several faults apart.
    Names are literal, never computed: docs/settings.md's tests read them from the source.
    """

    field: str
    type: Any
    default: Any = None
    accepts: str | None = None
    flag: str | None = None  # "--campaign"; None: no flag
    env: str | None = None  # the variable's whole name; None: no variable
    key: str | None = None  # the key in a file layer; None: not read from files
    check: Callable[[Any], Any] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    finite: bool = False  # refuse inf and nan
    secret: bool = False  # a token or key: a message about a bad value never repeats it (messages reach logs)


@dataclass(frozen=True)
class Loaded:
    """Each setting's value, and where those not left at their default came from."""

    values: dict[str, Any]
    origins: dict[str, str]


def load(
    settings: Sequence[Setting],
    *,
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    files: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ignore_empty: bool = False,
    message: str = PLAIN,
) -> Loaded:
    """Each setting from the first source that sets it: its flag, its variable, each file in turn, its default.

    Args:
        settings: what to read.
        flags: parsed command-line values by field; None (and a store_true flag's False) is "not given".
        environ: usually ``os.environ``; passed in so tests need not patch the process.
        files: (path, values) pairs, first wins; a bad value there is named "KEY in PATH".
        ignore_empty: a variable set to "" counts as unset (the agent); otherwise "" is a value.
        message: ``PLAIN`` or ``ASSIGNED``, the shape of a bad value's message.

    Returns:
        The checked values of every setting, defaults included.

    Raises:
        SettingError: naming the flag, variable or file key of the first bad value, the value and what is accepted.
    """
    from pydantic import ValidationError

    model = _model(tuple(settings))
    by_field = {setting.field: setting for setting in settings}
    found = _environment_values(model, environ, ignore_empty)
    raw: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for setting in settings:
        if setting.flag is not None and flags.get(setting.field) not in (None, False):
            raw[setting.field], origins[setting.field] = flags[setting.field], setting.flag
        elif setting.env is not None and setting.env in found:
            raw[setting.field], origins[setting.field] = found[setting.env], setting.env
        elif setting.key is not None:
            for path, values in files:
                if setting.key in values:
                    raw[setting.field], origins[setting.field] = values[setting.key], f"{setting.key} in {path}"
                    break
    try:
        checked = model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0])
        raise SettingError(
            _message(
                message,
                origins[field],
                _shown(by_field[field], raw[field]),
                by_field[field].accepts,
                error.get("ctx", {}),
            )
        ) from None
    return Loaded(values={field: getattr(checked, field) for field in by_field}, origins=origins)


def parse(setting: Setting, where: str, raw: Any, message: str = PLAIN) -> Any:
    """One raw value checked as ``setting`` says, for a program that finds its values itself (the site).

    Raises:
        SettingError: naming ``where``, the value and what is accepted.
    """
    from pydantic import ValidationError

    try:
        return _adapter(setting).validate_python(raw)
    except ValidationError as exc:
        context = exc.errors()[0].get("ctx", {})
        raise SettingError(_message(message, where, _shown(setting, raw), setting.accepts, context)) from None


class _Hidden:
    """Stands in for a secret's value in a message, where ``!r`` would print it."""

    def __repr__(self) -> str:
        return "<hidden>"


def _shown(setting: Setting, raw: Any) -> Any:
    return _Hidden() if setting.secret else raw


def _message(shape: str, where: str, raw: Any, accepts: str | None, context: Mapping[str, Any]) -> str:
    if accepts is None:  # the validator's own words, from the ValueError it raised
        accepts = str(context.get("error", "is not accepted"))
    return shape.format(where=where, raw=raw, accepts=accepts)


@functools.cache
def _adapter(setting: Setting) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(_pydantic_type(setting))


def _pydantic_type(setting: Setting) -> Any:
    """The type pydantic checks a setting's value against: its bounds, after its check."""
    from pydantic import BeforeValidator, Field

    metadata: list[Any] = [] if setting.check is None else [BeforeValidator(setting.check)]
    bounds = {name: getattr(setting, name) for name in ("ge", "gt", "le") if getattr(setting, name) is not None}
    if setting.finite:
        bounds["allow_inf_nan"] = False
    if bounds:
        metadata.append(Field(**bounds))
    return Annotated[(setting.type, *metadata)] if metadata else setting.type


@functools.cache
def _model(settings: tuple[Setting, ...]) -> Any:
    """A pydantic-settings model of these settings, built once per table."""
    from pydantic import Field, create_model
    from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

    class Sourced(BaseSettings):
        # Variables by their whole names, case and all; raw text, never JSON; fields filled by name;
        # defaults taken as written (a default of None means "follows another setting").
        model_config = SettingsConfigDict(
            case_sensitive=True,
            enable_decoding=False,
            populate_by_name=True,
            extra="ignore",
            frozen=True,
            validate_default=False,
        )

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings,)  # load() has chosen each value's source: never read os.environ here

    fields: dict[str, Any] = {
        setting.field: (_pydantic_type(setting), Field(setting.default, validation_alias=setting.env or setting.field))
        for setting in settings
    }
    return create_model("Settings", __base__=Sourced, **fields)


def _environment_values(model: Any, environ: Mapping[str, str], ignore_empty: bool) -> dict[str, Any]:
    """The model's variables that ``environ`` sets, by name, read by pydantic-settings."""
    return dict(_source_class()(model, environ, ignore_empty)())


@functools.cache
def _source_class() -> Callable[[Any, Mapping[str, str], bool], Any]:
    from pydantic_settings import EnvSettingsSource
    from pydantic_settings.sources.utils import parse_env_vars

    class MappingEnvSource(EnvSettingsSource):
        """pydantic-settings' variable reader, over a mapping passed in rather than the process's environment."""

        def __init__(self, settings_cls: Any, environ: Mapping[str, str], ignore_empty: bool) -> None:
            self._environ = environ
            super().__init__(settings_cls, case_sensitive=True, env_ignore_empty=ignore_empty)

        def _load_env_vars(self) -> Mapping[str, str | None]:
            return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    return MappingEnvSource

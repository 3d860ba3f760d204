"""Typed, bounded settings: one spec and one check for model configs, optimizer hyperparameters and campaign settings.

Torch-free on purpose: the site reads these specs to build its forms and to
validate what organizers, ``seed_run`` and the admin send, and the aggregator
reads the same specs, so a bound is written once and enforced everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

FieldKind = Literal["int", "float", "bool", "choice", "int_list"]


class ConfigError(ValueError):
    """A setting some spec refuses. ``field`` names it, so a form can show the message next to it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ConfigField:
    """One setting as forms and validators see it: its kind, default, bounds, label and help.

    ``minimum`` and ``maximum`` are inclusive unless ``open_minimum`` /
    ``open_maximum`` say the bound itself is refused (a learning rate must be
    above 0; a beta must stay below 1). ``optional`` settings may be None.
    ``choices`` lists the accepted strings of a ``choice`` field.
    """

    kind: FieldKind
    default: Any = None
    minimum: float = 1
    maximum: float = 1 << 20
    help: str = ""
    label: str = ""
    open_minimum: bool = False
    open_maximum: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False

    def bounds_text(self) -> str:
        """The accepted range in words, as error messages and help texts say it."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        low, high = _number(self.minimum), _number(self.maximum)
        if not (self.open_minimum or self.open_maximum):
            return f"between {low} and {high}"
        lower = f"above {low}" if self.open_minimum else f"at least {low}"
        upper = f"below {high}" if self.open_maximum else f"at most {high}"
        return f"{lower} and {upper}"

    def check(self, value: Any, where: str, *, field: str | None = None, error: type[ConfigError] = ConfigError) -> Any:
        """The value in its canonical type (int, float, bool, str or list of ints).

        Args:
            value: what was sent (JSON types; an int is accepted for a float field).
            where: how the message names the setting, e.g. ``"gpt.n_layer"``.
            field: the name forms know the setting by (the error's ``field``).
            error: the ConfigError subclass to raise.

        Raises:
            ConfigError: (of class ``error``) naming ``where``, the value and the accepted range.
        """
        if value is None:
            if self.optional:
                return None
            raise error(f"{where} is required", field)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise error(f"{where} must be true or false, got {value!r}", field)
            return value
        if self.kind == "choice":
            if value not in self.choices:
                raise error(f"{where} must be {self.bounds_text()}, got {value!r}", field)
            return value
        if self.kind == "int_list":
            if not isinstance(value, (list, tuple)) or not value:
                raise error(f"{where} must be a non-empty list of integers, got {value!r}", field)
            return [self._number(v, where, field, error, integer=True) for v in value]
        return self._number(value, where, field, error, integer=self.kind == "int")

    def _number(self, value: Any, where: str, field: str | None, error: type[ConfigError], *, integer: bool) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{where} must be {'an integer' if integer else 'a number'}, got {value!r}", field)
        if integer and not (math.isfinite(value) and float(value).is_integer()):
            raise error(f"{where} must be an integer, got {value!r}", field)
        too_low = value <= self.minimum if self.open_minimum else value < self.minimum
        too_high = value >= self.maximum if self.open_maximum else value > self.maximum
        if not math.isfinite(value) or too_low or too_high:
            raise error(f"{where} must be {self.bounds_text()}, got {value!r}", field)
        return int(value) if integer else float(value)


def _number(bound: float) -> str:
    # 1048576 reads better than 1.04858e+06, 1e-12 better than 0.000000000001, 1e+30 better than 31 digits.
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e20 else f"{bound:g}"

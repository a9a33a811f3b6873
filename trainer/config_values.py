"""A config's values: `coerce` turns a CLI override's text or a manifest's JSON value into a
field's declared type (bool, int, float, str, or one of a Literal's choices), and ConfigError is
the one-line error a bad one raises (trainer/config.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from replay.errors import InputError


class ConfigError(ValueError, InputError):
    """A bad preset name, override or value; the message is one line meant for users."""


def field_types(cls: type) -> dict[str, Any]:
    # `from __future__ import annotations` leaves field.type as a string; resolve it.
    return typing.get_type_hints(cls)


def coerce(value: Any, tp: Any, key: str, *, text: bool) -> Any:
    """Turn a CLI string (text=True) or a JSON value (text=False, no string parsing) into
    a value of type `tp`, or raise ConfigError."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, choices))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if text and isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
            try:  # "1e6" is a natural way to write a step count
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} is not a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} is not a string")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover


def valid_keys(cls: type, prefix: str = "") -> str:
    return ", ".join(prefix + f.name for f in dataclasses.fields(cls))

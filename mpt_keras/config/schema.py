"""The config dataclasses' JSON form: parsed strictly, written back, merged. A section's keys
are its dataclass's fields, typed by its hints.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Mapping
from typing import Any

from mpt_keras import checks
from mpt_keras.config import key_checks as check
from mpt_keras.config.component_sections import ComponentConfig
from mpt_keras.config.names import SOURCE_KEYS
from mpt_keras.errors import UserInputError
from mpt_keras.scaling.settings import LossScaleSettings, check_settings

# Fields that are no config keys: the run decides them (dynamic scale only with float16
# layers; gradients summed in their own dtype).
RUN_DECIDES = {LossScaleSettings: ("dynamic", "all_reduce_dtype")}

_UnionType = type(int | None)
_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Mapping: "a JSON object",
    tuple: "a JSON array",
    type(None): "null",
}


def keys(cls: type) -> list[str]:
    """The JSON keys of dataclass `cls`, in field order."""
    hidden = RUN_DECIDES.get(cls, ())
    return [field.name for field in dataclasses.fields(cls) if field.name not in hidden]


def to_plain(value: Any) -> Any:
    """A config dataclass as JSON-serialisable values; `build` inverts it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: to_plain(getattr(value, name)) for name in keys(type(value))}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(item) for item in value)
    if isinstance(value, Mapping):
        return {name: to_plain(item) for name, item in value.items()}
    return value


def build(cls: type, values: Any, prefix: str = "") -> Any:
    """Instantiates dataclass `cls` from JSON-like `values`, checking keys and types;
    `prefix` (`"data."`) names the section in messages."""
    if not isinstance(values, Mapping):
        what = check.key(prefix.rstrip(".")) if prefix else "config"
        raise checks.refusal(what, checks.as_json(values), "a JSON object")
    allowed = keys(cls)
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise UserInputError(
            f"unknown key '{prefix}{unknown[0]}'. Allowed keys"
            f"{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(allowed)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _convert(hints[name], value, f"{prefix}{name}") for name, value in values.items()
    }
    if cls is LossScaleSettings:
        # Checked here first: messages name config keys, not Python arguments.
        defaults = {field.name: field.default for field in dataclasses.fields(cls)}
        check_settings(
            {**defaults, **kwargs}, what=lambda name: check.key(prefix + name), show=checks.as_json
        )
    if cls is not ComponentConfig:
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except UserInputError as error:
        # A loss or metric knows not its own key: prefix it.
        raise UserInputError(f"{prefix.rstrip('.')}: {error}") from None


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` merged into `base`: objects key by key, other values replace; a section
    given a new source drops its old source and options."""
    merged = dict(base)
    for name, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(name), Mapping):
            section = dict(merged[name])
            if any(value.get(source) is not None for source in SOURCE_KEYS):
                for stale in (*SOURCE_KEYS, "options"):
                    section.pop(stale, None)
            merged[name] = deep_merge(section, value)
        else:
            merged[name] = value
    return merged


def _convert(hint: Any, value: Any, name: str) -> Any:
    """Checks `value` against type `hint`, recursing into nested dataclasses."""
    allowed = (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
    )
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is ComponentConfig and isinstance(value, str):
            return build(kind, {"name": value}, prefix=name + ".")
        if dataclasses.is_dataclass(kind):
            return build(kind, value, prefix=name + ".")
        if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(kind)[0]
            return tuple(
                _convert(item, part, f"{name}[{index}]") for index, part in enumerate(value)
            )
        if kind is bool and isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            # NaN, infinities and ints beyond floats.
            check.require(abs(value) <= sys.float_info.max, name, "a finite number", value)
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is Mapping and isinstance(value, Mapping):
            return dict(value)
    names = " or ".join(
        _TYPE_NAMES.get(typing.get_origin(kind) or kind, str(kind)) for kind in allowed
    )
    raise checks.refusal(check.key(name), checks.as_json(value), names)

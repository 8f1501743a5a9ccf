"""absl flags declared from a dataclass's fields, and their values read back by field.

The type and default come from the field, the help and bounds from the launcher.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags

_FIELD_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class FieldFlag:
    """How one field is offered as a flag: `choices` make a string's an enum
    flag, `default` replaces the field's."""

    help: str
    choices: Sequence[str] | None = None
    lower_bound: float | None = None
    upper_bound: float | None = None
    default: Any = _FIELD_DEFAULT


def define(
    cls: type, fields: Mapping[str, FieldFlag], module_name: str, unset: bool = False
) -> dict[str, flags.FlagHolder]:
    """Defines `--<field>` for each of `fields`, typed as the field; returns the holders.

    Args:
        module_name: The launcher's module (`__name__`), whose `--help` lists them.
        unset: Every default is `None`, so a flag not given leaves the field to
            an earlier layer (a config file).
    """
    hints = typing.get_type_hints(cls)
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    holders = {}
    for name, spec in fields.items():
        kind = _without_none(hints[name])
        default = None if unset else defaults[name]
        if spec.default is not _FIELD_DEFAULT:
            default = spec.default
        common = {"module_name": module_name}
        bounds = {"lower_bound": spec.lower_bound, "upper_bound": spec.upper_bound}
        if typing.get_origin(kind) is tuple:
            value = None if default is None else list(default)
            holder = flags.DEFINE_list(name, value, spec.help, **common)
        elif kind is bool:
            holder = flags.DEFINE_bool(name, default, spec.help, **common)
        elif kind is int:
            holder = flags.DEFINE_integer(name, default, spec.help, **bounds, **common)
        elif kind is float:
            holder = flags.DEFINE_float(name, default, spec.help, **bounds, **common)
        elif spec.choices is not None:
            holder = flags.DEFINE_enum(name, default, spec.choices, spec.help, **common)
        else:
            holder = flags.DEFINE_string(name, default, spec.help, **common)
        holders[name] = holder
    return holders


def values(holders: Mapping[str, flags.FlagHolder]) -> dict[str, Any]:
    """The flags' values by field name, lists as tuples (`cls(**values(...))`)."""
    return {
        name: tuple(holder.value) if isinstance(holder.value, list) else holder.value
        for name, holder in holders.items()
    }


def _without_none(hint: Any) -> Any:
    """`X` of `X | None`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else hint
    return hint

"""Config value checks in `mpt_keras.checks`' form: the key as written
(`key 'data.batch_size'`), the value as JSON."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from mpt_keras import checks
from mpt_keras.config.components import check_factory_syntax


def key(name: str) -> str:
    """`key 'name'`: how a message names a config key."""
    return f"key '{name}'"


def number(name: str, value: Any, **bounds: Any) -> None:
    """`checks.check_number` for config key `name` (bounds as there)."""
    checks.check_number(key(name), value, show=checks.as_json, **bounds)


def choice(name: str, value: Any, choices: Collection[str]) -> None:
    """`checks.check_choice` for config key `name`."""
    checks.check_choice(key(name), value, choices, show=checks.as_json)


def require(ok: bool, name: str, allowed: str, value: Any) -> None:
    """Refuses `value` of key `name` unless `ok`; `allowed`: what is."""
    if not ok:
        raise checks.refusal(key(name), checks.as_json(value), allowed)


def one_source(config: Any, section: str, keys: tuple[str, ...]) -> None:
    """Checks `config` names exactly one of `keys`, and a factory's syntax; `section` is
    empty for a loss or metric (the parser adds its key)."""
    given = [name for name in keys if getattr(config, name) is not None]
    if len(given) != 1:  # None given: only a loss or metric (others have defaults).
        what = f"{section}: the source" if section else "the source"
        received = " and ".join(f"'{name}'" for name in given) or "none"
        raise checks.refusal(
            what, received, f"exactly one of {', '.join(repr(name) for name in keys)}"
        )
    if config.factory is not None:
        check_factory_syntax(config.factory, f"{section}.factory" if section else "factory")


def is_feature_map(features: Mapping[str, Any]) -> bool:
    """Whether `features` is `{"x": FEATURE or {INPUT: FEATURE}, "y": FEATURE}`."""
    x = features.get("x")
    return (
        set(features) == {"x", "y"}
        and isinstance(features["y"], str)
        and (
            isinstance(x, str)
            or (isinstance(x, Mapping) and bool(x) and all(isinstance(v, str) for v in x.values()))
        )
    )

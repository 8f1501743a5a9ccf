"""A manifest's rules: `Rule` (which layers, what policy) and strict parsing of its JSON form.

Errors name the key where the rule was (`rules[2].policy`); the manifest adds the file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import keras

from mpt_keras.checks import as_json, refusal
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8_gemms import DEFAULT_RECIPE, RECIPES
from mpt_keras.precision.names import FLOAT8, RULE_POLICIES, check_policy_name

RULE_KEYS = ("match", "policy", "scaling", "reason")
MATCH_KEYS = ("path", "class")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One manifest rule: which layers it matches and the policy they take.

    `path` is a layer path or a regex matching whole paths; `layer_class` (`"class"` in JSON)
    a class name the layer's class is or derives from; `None` matches any. `scaling`, for
    `float8` only: `delayed` (Keras', the default) or `current` (`float8_gemms`).
    """

    policy: str
    path: str | None = None
    layer_class: str | None = None
    reason: str | None = None
    scaling: str | None = None

    def __post_init__(self):
        check_policy_name(self.policy, "policy", RULE_POLICIES, show=as_json)
        if self.path is None and self.layer_class is None:
            raise UserInputError("match: empty. Allowed keys: path, class (one or both)")
        for key, value in (("path", self.path), ("class", self.layer_class)):
            if value is not None and not (isinstance(value, str) and value):
                raise refusal(f"match.{key}", as_json(value), "a non-empty string")
        if self.path is not None:
            try:
                re.compile(self.path)
            except (re.error, OverflowError) as error:  # Overflow: a repeat count > 2**32.
                raise UserInputError(f"match.path: bad regex '{self.path}': {error}") from None
            except RecursionError:
                raise UserInputError(
                    f"match.path: bad regex '{self.path}': groups nested too deeply"
                ) from None
        if self.scaling is not None:
            if self.policy != FLOAT8:
                raise refusal(
                    "scaling", as_json(self.scaling), "no scaling (it is for policy float8)"
                )
            if self.scaling not in RECIPES:
                raise refusal("scaling", as_json(self.scaling), " or ".join(RECIPES))
        if self.reason is not None and not isinstance(self.reason, str):
            raise refusal("reason", as_json(self.reason), "a string")

    @property
    def float8_recipe(self) -> str:
        """The float8 scaling its layers train with."""
        return self.scaling or DEFAULT_RECIPE

    @property
    def match_text(self) -> str:
        """What the rule matches, e.g. `path 'logits', class 'Dense'`."""
        parts = [f"path '{self.path}'"] if self.path is not None else []
        if self.layer_class is not None:
            parts.append(f"class '{self.layer_class}'")
        return ", ".join(parts)

    def matches(self, path: str | Iterable[str], layer: keras.layers.Layer) -> bool:
        """Whether `layer`, at `path` or every form of it (`LayerPath.forms`), matches: the
        rule's `path` equal to a form or matching it whole (`re.fullmatch`, as Keras'
        `DTypePolicyMap`), `class` naming any base class."""
        forms = (path,) if isinstance(path, str) else tuple(path)
        if self.path is not None and self.path not in forms:
            if not any(re.fullmatch(self.path, form) for form in forms):
                return False
        return self.layer_class is None or any(
            cls.__name__ == self.layer_class for cls in type(layer).__mro__
        )

    def to_dict(self) -> dict[str, Any]:
        """The rule as in a manifest file."""
        match = {"path": self.path, "class": self.layer_class}
        values = {
            "match": {key: value for key, value in match.items() if value is not None},
            "policy": self.policy,
        }
        if self.scaling is not None:
            values["scaling"] = self.scaling
        if self.reason is not None:
            values["reason"] = self.reason
        return values


def rule_label(index: int, rule: Rule) -> str:
    """How reports name a rule: `rules[<i>] (<match>)`."""
    return f"rules[{index}] ({rule.match_text})"


def check_keys(values: Any, allowed: tuple[str, ...], required: tuple[str, ...], where: str):
    """Checks that `values` is a JSON object with only `allowed` and all `required` keys;
    `where`: the key holding it (`rules[0].match`), "" at the top level."""
    if not isinstance(values, Mapping):
        raise refusal(where, as_json(values), "a JSON object")
    prefix, scope = (f"{where}.", f" in {where}") if where else ("", "")
    for key in values:
        if key not in allowed:
            raise UserInputError(
                f"unknown key '{prefix}{key}'. Allowed keys{scope}: {', '.join(allowed)}"
            )
    for key in required:
        if key not in values:
            raise UserInputError(
                f"missing key '{prefix}{key}'. Required keys{scope}: {', '.join(required)}"
            )


def parse_rule(values: Any, where: str) -> Rule:
    """The rule at key `where` (`rules[0]`) of a manifest; errors name `where`."""
    check_keys(values, RULE_KEYS, ("match", "policy"), where)
    check_keys(values["match"], MATCH_KEYS, (), f"{where}.match")
    try:
        return Rule(
            policy=values["policy"],
            path=values["match"].get("path"),
            layer_class=values["match"].get("class"),
            reason=values.get("reason"),
            scaling=values.get("scaling"),
        )
    except UserInputError as error:
        raise UserInputError(f"{where}.{error}") from None

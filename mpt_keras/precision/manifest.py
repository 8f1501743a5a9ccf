"""Precision manifests: JSON rules that give each layer of a model its dtype policy.

The user's guide is docs/precision.md; this is the contract. A manifest file:

    {"version": 1, "default": "mixed_bfloat16", "safe_defaults": true, "rules": [
      {"match": {"path": "block_\\\\d+/attention/.*"}, "policy": "mixed_float16"},
      {"match": {"class": "Dense", "path": "logits"}, "policy": "float32",
       "reason": "feeds the loss"}]}

`version` (1) and `default` are required; `safe_defaults` (default true), `rules` and a
rule's `reason` are optional. Policies are `names.POLICY_NAMES` (variables always float32); a
rule's may also be `float8`, for built `Dense`/`EinsumDense` layers only (matmuls in float8,
the rest in `default`). Any other key or value is an error naming the file, the key
(`rules[2].policy`) and what is allowed.

Matching: `rules.Rule.matches`, on every form of a layer's path (`LayerPath.forms`), so one
manifest serves every instance of a model. A layer found at several paths has one policy.

Precedence: the first matching rule in file order; else a safe default
(`decisions.SAFE_DEFAULTS`: normalization and output layers stay float32); else `default`.

Saving keeps the policies (`application`), except for layers without a Keras path,
subclassed models and keras_hub backbones: apply again after loading. Layers created at build
are decided then (missing from that report). Applying makes the model's traced train, test
and predict functions again (Keras keeps them, with the dtypes they were traced with). A
compiled model keeps its optimizer: a manifest that would make it compute in float16 under
an optimizer without loss scaling is refused (compile after applying, and the compile hook
scales the loss).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import keras

from mpt_keras.checks import as_json, refusal
from mpt_keras.errors import UserInputError
from mpt_keras.files import read_json_object, write_text_atomic
from mpt_keras.keras_bridge.layer_paths import LayerPath, iter_layer_paths
from mpt_keras.keras_bridge.traced_functions import forget_traced_functions
from mpt_keras.precision.application import Application, units
from mpt_keras.precision.decisions import Decider
from mpt_keras.precision.float8 import check_optimizer_unbuilt, is_float8, to_float8
from mpt_keras.precision.names import FLOAT8, check_policy_name
from mpt_keras.precision.report import PrecisionReport, precision_report
from mpt_keras.precision.rules import Rule, check_keys, parse_rule, rule_label

_MANIFEST_KEYS = ("version", "default", "safe_defaults", "rules")


@dataclasses.dataclass(frozen=True)
class PrecisionManifest:
    """A dtype policy per layer, decided by ordered rules (first match wins); see the module."""

    default: str
    rules: tuple[Rule, ...] = ()
    safe_defaults: bool = True
    version: int = 1

    def __post_init__(self):
        if type(self.version) is not int or self.version != 1:
            raise refusal("version", as_json(self.version), "1")
        check_policy_name(self.default, "default", show=as_json)
        if not isinstance(self.safe_defaults, bool):
            raise refusal("safe_defaults", as_json(self.safe_defaults), "true, false")
        object.__setattr__(self, "rules", tuple(self.rules))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "manifest") -> PrecisionManifest:
        """Builds a manifest from a JSON-like mapping, strictly: errors (`UserInputError`)
        name `source` (a file) and the key."""
        if not isinstance(values, Mapping):
            raise refusal(source, as_json(values), "a JSON object")
        try:
            check_keys(values, _MANIFEST_KEYS, ("version", "default"), where="")
            rules = values.get("rules", [])
            if not isinstance(rules, list):
                raise refusal("rules", as_json(rules), "a JSON array")
            return cls(
                version=values["version"],
                default=values["default"],
                safe_defaults=values.get("safe_defaults", True),
                rules=tuple(
                    parse_rule(rule, f"rules[{index}]") for index, rule in enumerate(rules)
                ),
            )
        except UserInputError as error:
            raise UserInputError(f"{source}: {error}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> PrecisionManifest:
        """Reads a manifest file; see `from_dict`. Malformed JSON: an error with line, column."""
        return cls.from_dict(read_json_object(path), source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        """The manifest as in a file; `from_dict` inverts it."""
        return {
            "version": self.version,
            "default": self.default,
            "safe_defaults": self.safe_defaults,
            "rules": [rule.to_dict() for rule in self.rules],
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The manifest as indented JSON text, also written to `path` (through a rename) when
        given: the file `from_json(path)` reads."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            write_text_atomic(path, text)
        return text

    def decide(self, model: keras.Model, inputs: Any = None) -> dict[str, str]:
        """`{layer path: policy name}` as `apply` would decide each (`float8` for a float8
        rule's layers), setting nothing: a model in use (compiled, trained) is left as it is."""
        entries = list(iter_layer_paths(model))
        decider = Decider(self.rules, self.default, self.safe_defaults, model, entries, inputs)
        return {entry.path: decider.decide(entry).policy for entry in entries}

    def apply(self, model: keras.Model, inputs: Any = None) -> PrecisionReport:
        """Sets the dtype policy of every layer of `model` (built or not), nested ones included.

        Applying again replaces an earlier apply; the model's own policy is left. `inputs`:
        what the report traces (`report.precision_report`), and, concrete, what a built
        subclassed model is called on to show which layers make its outputs (safe defaults).

        Returns the precision report with the decisions and unmatched and shadowed rules.
        Raises `UserInputError`, changing nothing, if the model has float16 or bfloat16
        variables, a float8 rule cannot be honoured, or a compiled model would compute in
        float16 under an optimizer that does not scale the loss.
        """
        for variable in model.weights:
            if variable.dtype in ("float16", "bfloat16"):
                raise UserInputError(
                    f"model '{model.name}': variable '{variable.path}' is {variable.dtype}; "
                    "a manifest keeps variables float32. Allowed: a model built under "
                    "float32, mixed_float16 or mixed_bfloat16"
                )
        entries = list(iter_layer_paths(model))
        decider = Decider(self.rules, self.default, self.safe_defaults, model, entries, inputs)
        application = Application(decider, self.default)
        if any(rule.policy == FLOAT8 for rule in self.rules):
            decider.check_float8(entries)
            turning: dict[int, str] = {}  # By layer: a shared one is found at several paths.
            for entry in entries:
                if decider.decide(entry).policy == FLOAT8 and not is_float8(entry.layer):
                    turning.setdefault(id(entry.layer), entry.path)
            check_optimizer_unbuilt(model, list(turning.values()))
        _check_loss_scaled(model, entries, application)
        model_units = list(units(entries))
        decisions = {}
        for unit in model_units:
            decisions.update(application.apply_to_unit(unit))
        float8 = {
            path: self.rules[decision.matched[0]].float8_recipe
            for path, decision in decisions.items()
            if decision.policy == FLOAT8
        }
        if float8:
            for recipe in sorted(set(float8.values())):
                to_float8(model, [p for p, r in float8.items() if r == recipe], recipe)
            for unit in model_units:  # Again: a policy map now holds each one's float8 policy.
                application.apply_to_unit(unit)
        forget_traced_functions(model)
        matched = {index for decision in decisions.values() for index in decision.matched}
        deciding = {decision.matched[0] for decision in decisions.values() if decision.matched}
        described = precision_report(model, inputs)
        return dataclasses.replace(
            described,
            layers=tuple(
                dataclasses.replace(
                    layer,
                    decided_by=decisions[layer.path].decided_by,
                    reason=decisions[layer.path].reason,
                )
                for layer in described.layers
            ),
            unmatched_rules=tuple(
                rule_label(index, rule)
                for index, rule in enumerate(self.rules)
                if index not in matched
            ),
            shadowed_rules=tuple(
                rule_label(index, self.rules[index]) for index in sorted(matched - deciding)
            ),
        )


def _check_loss_scaled(
    model: keras.Model, entries: list[LayerPath], application: Application
) -> None:
    """Raises `UserInputError` if `apply` would make a compiled model compute in float16 under
    an optimizer that does not scale its loss: the compile hook scales only at `compile`, and
    the small float16 gradients would underflow to zero. A model computing in float16 already
    was compiled so: a missing loss scale there is the user's choice (`auto_scale_loss=False`,
    which the hook warned about). `keras.saving.load_model` compiles a model by default."""
    optimizer = model.optimizer if model.compiled else None
    if optimizer is None or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    layers = [model, *(entry.layer for entry in entries)]
    if any(layer.compute_dtype == "float16" for layer in layers):  # Through a policy map.
        return
    made = [
        entry.path
        for entry in entries
        if application.planned_policy(entry).compute_dtype == "float16"
    ]
    if made:
        raise UserInputError(
            f"model '{model.name}': compiled with {type(optimizer).__name__}, which does not "
            f"scale the loss, and this manifest makes {len(made)} of its layers compute in "
            f"float16 ('{made[0]}' first), whose small gradients would underflow to zero. "
            "Allowed: apply the manifest before compile (which then wraps the optimizer in "
            "mpt_keras.LossScaleOptimizer), compile with mpt_keras.LossScaleOptimizer before "
            "applying it, or load the model with compile=False"
        )

"""Calibration's manifest: an exact-path rule per layer off the default, float8 rules first,
the model's name in front where a rule would catch another layer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection

import keras

from mpt_keras.calibration.decisions import Decision
from mpt_keras.calibration.float8 import Float8Layer
from mpt_keras.keras_bridge.layer_paths import first_instance_name, iter_layer_paths
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.names import FLOAT8
from mpt_keras.precision.rules import Rule


def exact_rule(policy: str, path: str, reason: str) -> Rule:
    """A rule matching `path` alone (regex-escaped)."""
    return Rule(policy, path=re.escape(path), reason=reason)


def calibrated_manifest(
    model: keras.Model,
    default: str,
    decisions: dict[str, Decision],
    safe_defaults: dict[str, Rule],
    float8_layers: dict[str, Float8Layer],
    float8_candidates: dict[str, keras.layers.Layer],
) -> PrecisionManifest:
    """The manifest giving each layer its decision (dicts by path).

    `safe_defaults`: their float32 rules (those sites need no rule of their own). A float8
    policy in `float8_layers` gets a float8 rule; `float8_candidates`: those layers.
    """
    rules = tuple(
        exact_rule(decision.policy, path, decision.reason)
        for path, decision in decisions.items()
        if path not in safe_defaults and decision.policy != default
    )
    manifest = _uncaught(
        model,
        PrecisionManifest(default, rules),
        decisions,
        safe_defaults,
        {path for path, layer in float8_layers.items() if layer.policy == FLOAT8},
    )
    float8_rules = _float8_rules(model, float8_layers, float8_candidates)
    return dataclasses.replace(manifest, rules=(*float8_rules, *manifest.rules))


def _uncaught(
    model: keras.Model,
    manifest: PrecisionManifest,
    decisions: dict[str, Decision],
    safe_defaults: dict[str, Rule],
    float8_paths: Collection[str],
) -> PrecisionManifest:
    """`manifest`, with a first rule for each layer a rule meant for another catches.

    A rule for the model's own `dense` also matches a nested `backbone/dense`: the added rules
    prefix the model's name, a path form no other layer has. Float8 layers (their rules go first
    and match them alone) are skipped.
    """
    decided = [*safe_defaults.items()] + [
        (path, exact_rule(decision.policy, path, decision.reason))
        for path, decision in decisions.items()
        if path not in safe_defaults
    ]
    policies = manifest.decide(model)
    model_name = first_instance_name(model)
    caught = tuple(
        dataclasses.replace(rule, path=re.escape(f"{model_name}/{path}"))
        for path, rule in decided
        if policies[path] != rule.policy and path not in float8_paths
    )
    return dataclasses.replace(manifest, rules=(*caught, *manifest.rules))


def _float8_rules(
    model: keras.Model,
    float8_layers: dict[str, Float8Layer],
    candidates: dict[str, keras.layers.Layer],
) -> tuple[Rule, ...]:
    """A float8 rule for each layer whose `policy` is float8, matching it alone.

    Checked on every layer's path forms, not by `apply`, which would turn them float8 for good.
    """
    chosen = [path for path, layer in float8_layers.items() if layer.policy == FLOAT8]
    entries = list(iter_layer_paths(model)) if chosen else []
    model_name = first_instance_name(model)
    rules = []
    for path in chosen:
        rule = exact_rule(FLOAT8, path, float8_layers[path].reason)
        if any(rule.matches(e.forms, e.layer) for e in entries if e.layer is not candidates[path]):
            rule = dataclasses.replace(rule, path=re.escape(f"{model_name}/{path}"))
        rules.append(rule)
    return tuple(rules)

"""Precision manifests: JSON rules that give each layer of a model its dtype policy.

Why one module (past 450 lines, a fifth of them this docstring): the file
format, its matching and its application to a model are one contract, stated
whole here; the report, the names, float8 and promotion are modules of their
own in this package, paths and their forms `layer_paths`'.

A manifest file:

    {
      "version": 1,
      "default": "mixed_bfloat16",
      "safe_defaults": true,
      "rules": [
        {"match": {"path": "block_\\\\d+/attention/.*"}, "policy": "mixed_float16"},
        {"match": {"class": "Dense", "path": "logits"}, "policy": "float32",
         "reason": "feeds the loss"}
      ]
    }

`version` (must be 1) and `default` are required; `safe_defaults` (default
true) and `rules` (default none) are optional, as is each rule's `reason`.
Policies are `float32`, `mixed_float16` and `mixed_bfloat16`, so variables are
always float32; a rule's may also be `float8`, for `Dense` and `EinsumDense`
layers only (`float8`: their matmuls in float8, the rest in `default`; the
layer must be built, and its policy reads `float8_from_<default>`). Any other
key, a bad policy or a bad regex is an error naming the file, the rule
(`rules[2].policy`) and what is allowed.

Matching. A layer's path is the layer names from the model down, joined by
"/" (`block_0/attention/query`); a layer Keras gives no path, made by a layer
for itself, is named by the attribute holding it (`block_0/attention/_softmax`).
A rule's `path` is tried against every form of a layer's path
(`layer_paths.LayerPath.forms`): the path from the model; from each nested
model holding the layer, which is Keras' own `layer.path` there; each with
that model's name in front; and with every model name Keras numbered
(`gpt2_backbone_1`, `functional_2`) read as its first instance's
(`gpt2_backbone`). So one manifest serves every instance of a model, bare or
wrapped: `transformer_layer_0/.*` and `gpt2_backbone/transformer_layer_0/.*`
both match the first block of any GPT2 backbone. A rule's `path` matches a
form equal to it, or else one it matches as a whole (`re.fullmatch`), as in
Keras' `DTypePolicyMap`: `block_0` is that layer only, `block_0/.*` is all
below it. As Keras' path of a nested functional model's layer leaves that
model out, `dense` matches both `dense` and `backbone/dense`: write
`backbone/dense` for the nested one, and `<model name>/dense` for the outer
one alone. A rule's `class` matches the layer's class name or the name of
any class it derives from (`"Dense"` matches subclasses of Dense). A rule
with both matches layers that match both. A layer found at several paths
(GPT2CausalLM's token embedding, in its backbone and in the causal LM) is
tried in the forms of all of them: it has one policy.

Precedence. Each layer takes the policy of the first rule, in file order, that
matches it; else its safe default (below); else `default`. So an explicit rule
always beats a safe default, and a specific rule goes before a general one.

Safe defaults (`SAFE_DEFAULTS`; `"safe_defaults": false` turns them off). As
PyTorch autocast keeps a list of ops in float32, these layers stay float32
unless a rule matches them:

    normalization  a class (or base class) named *Normalization, *Norm or
                   RMSNorm*: LayerNormalization, BatchNormalization,
                   GroupNormalization, UnitNormalization, RMSNormalization and
                   user layers named like them. A mean and variance taken over
                   many features in float16/bfloat16 round badly, and a small
                   variance under a square root and a division amplifies it.
    model output   the layers whose outputs are the model's outputs, which feed
                   the loss: a softmax or log in low precision over- or
                   underflows and rounds the loss. Found from the outputs of a
                   functional model (recursing into a nested model), the last
                   layer of a Sequential, and for a subclassed model the last
                   of its own layers (in assignment order) that has weights or
                   is not built yet.

Layers a layer makes for itself. Rules reach every layer Keras tracks, those
Keras gives no path included (a MultiHeadAttention's `_softmax` and
`_dropout_layer`, also in keras_hub's CachedMultiHeadAttention):
`{"class": "Softmax"}` or `{"path": ".*/_softmax"}` keeps every attention
softmax in float32 while its block computes in float16; the scores are cast
to float32 as they enter it, and to float16 as the next layer takes them. A
MultiHeadAttention without dropout that returns no scores calls the fused
`ops.dot_product_attention` instead of its `_softmax`; Keras' TensorFlow
backend computes that softmax in float32 whatever the policies (the product
of queries and keys before it in the attention's own).

How policies stick. `apply` sets each layer's own policy, so a container's
policy never overrides its children's. A layer built under another policy
computes in the new one from its next call (Keras reads the policy at each
call; variables stay float32). A model stores the config of each of its
top-level layers only, and a layer such as DecoderBlock or MultiHeadAttention
re-creates its sublayers with its own policy; so when the sublayers of a
top-level layer differ from it, that layer gets a Keras `DTypePolicyMap`
holding each sublayer's policy by path. Saved with `model.save`, the map is
in the layer's config, and on loading each sublayer created with
`dtype=self.dtype_policy` (as Keras' and keras_hub's layers and DecoderBlock
do) computes in its own policy again. Not a layer without a Keras path:
Keras looks only paths up in a map, so after `keras.saving.load_model` an
attention's `_softmax` computes in the policy of the top-level layer holding
it (its block's) until the manifest is applied again. A subclassed model,
and a keras_hub backbone, whose config holds its arguments, re-create their
layers in their own `__init__`, in the model's policy: apply the manifest
again after loading them, too.

Models not built yet. Layers that exist are decided at once. Layers a layer
creates when it is built (MultiHeadAttention's projections) are decided by the
same rules when it is built; they are missing from the report of that `apply`
(rules only they match count as unmatched): apply again after building for a
complete report. Apply before `compile`, or compile again: a step traced
before keeps the dtypes it was traced with.

Example:

    manifest = PrecisionManifest.from_json("configs/manifests/digits_cnn.json")
    report = manifest.apply(model)
    report.policies["logits"]  # 'float32'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.errors import UserInputError
from mpt_keras.files import read_json_object
from mpt_keras.keras_bridge.layer_paths import LayerPath, iter_layer_paths, iter_layers
from mpt_keras.precision.float8 import check_float8_layer, is_float8, to_float8
from mpt_keras.precision.names import FLOAT8, RULE_POLICIES, check_policy_name
from mpt_keras.precision.report import PrecisionReport, precision_report

SAFE_DEFAULTS = {
    "normalization": "mean and variance round badly in float16/bfloat16",
    "model output": "feeds the loss: softmax and log over- or underflow in low precision",
}

_NORMALIZATION_CLASS = re.compile(r".*Norm(alization)?|RMSNorm.*")
_MANIFEST_KEYS = ("version", "default", "safe_defaults", "rules")
_RULE_KEYS = ("match", "policy", "reason")
_MATCH_KEYS = ("path", "class")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One manifest rule: which layers it matches and the policy they take.

    Attributes:
        policy: The policy name the matching layers take.
        path: A layer path, or a regex that matches whole paths; `None`: any.
        layer_class: A class name the layer's class is or derives from
            (`"class"` in JSON); `None`: any.
        reason: Why, for the report; optional.

    Example:

        rule = Rule(policy="float32", layer_class="LayerNormalization")
        rule.matches("final_norm", keras.layers.LayerNormalization())  # True
    """

    policy: str
    path: str | None = None
    layer_class: str | None = None
    reason: str | None = None

    def __post_init__(self):
        check_policy_name(self.policy, "policy", RULE_POLICIES)
        if self.path is None and self.layer_class is None:
            raise UserInputError("match: empty. Allowed keys: path, class (one or both)")
        for key, value in (("path", self.path), ("class", self.layer_class)):
            if value is not None and not (isinstance(value, str) and value):
                raise UserInputError(
                    f"match.{key}: must be a non-empty string, received {_shown(value)}"
                )
        if self.path is not None:
            try:
                re.compile(self.path)
            except (re.error, OverflowError) as error:  # Overflow: a repeat count > 2**32.
                raise UserInputError(f"match.path: bad regex '{self.path}': {error}") from None
            except RecursionError:
                raise UserInputError(
                    f"match.path: bad regex '{self.path}': groups nested too deeply"
                ) from None
        if self.reason is not None and not isinstance(self.reason, str):
            raise UserInputError(f"reason: must be a string, received {_shown(self.reason)}")

    @property
    def match_text(self) -> str:
        """What the rule matches, e.g. `path 'logits', class 'Dense'`."""
        parts = [f"path '{self.path}'"] if self.path is not None else []
        if self.layer_class is not None:
            parts.append(f"class '{self.layer_class}'")
        return ", ".join(parts)

    def matches(self, path: str | Iterable[str], layer: keras.layers.Layer) -> bool:
        """Whether `layer` matches; see the module docstring.

        Args:
            path: The layer's path, or every form of it (`LayerPath.forms`).
            layer: The layer.
        """
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
        if self.reason is not None:
            values["reason"] = self.reason
        return values


@dataclasses.dataclass(frozen=True)
class PrecisionManifest:
    """A dtype policy per layer, decided by ordered rules; see the module docstring.

    Attributes:
        default: The policy of layers that no rule or safe default decides.
        rules: The rules, first match wins.
        safe_defaults: Keep normalization and output layers float32 unless a
            rule matches them.
        version: The file format version; 1.

    Example:

        manifest = PrecisionManifest.from_dict({
            "version": 1,
            "default": "mixed_bfloat16",
            "rules": [{"match": {"class": "Conv2D"}, "policy": "float32"}],
        })
        cnn = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
        report = manifest.apply(cnn)
        report.policies["conv_1"], report.policies["dense"]  # ('float32', 'mixed_bfloat16')
    """

    default: str
    rules: tuple[Rule, ...] = ()
    safe_defaults: bool = True
    version: int = 1

    def __post_init__(self):
        if type(self.version) is not int or self.version != 1:
            raise UserInputError(f"version: must be 1, received {_shown(self.version)}")
        check_policy_name(self.default, "default")
        if not isinstance(self.safe_defaults, bool):
            raise UserInputError(
                f"safe_defaults: must be true or false, received {_shown(self.safe_defaults)}"
            )
        object.__setattr__(self, "rules", tuple(self.rules))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "manifest") -> PrecisionManifest:
        """Builds a manifest from a JSON-like mapping, strictly.

        Args:
            values: Keys and values as in the JSON file.
            source: What the values came from (a file name), for messages.

        Raises:
            UserInputError: On an unknown or missing key, a wrong type, an
                unknown policy, a bad regex or an empty match, naming `source`.
        """
        try:
            _check_keys(values, _MANIFEST_KEYS, ("version", "default"), where="")
            rules = values.get("rules", [])
            if not isinstance(rules, list):
                raise UserInputError(f"rules: must be a JSON array, received {_shown(rules)}")
            return cls(
                version=values["version"],
                default=values["default"],
                safe_defaults=values.get("safe_defaults", True),
                rules=tuple(
                    _parse_rule(rule, f"rules[{index}]") for index, rule in enumerate(rules)
                ),
            )
        except UserInputError as error:
            raise UserInputError(f"{source}: {error}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> PrecisionManifest:
        """Reads a manifest file; see `from_dict`. Malformed JSON is an error
        naming the file, line and column."""
        return cls.from_dict(read_json_object(path), source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        """The manifest as in a file; `from_dict` inverts it."""
        return {
            "version": self.version,
            "default": self.default,
            "safe_defaults": self.safe_defaults,
            "rules": [rule.to_dict() for rule in self.rules],
        }

    def to_json(self) -> str:
        """The manifest as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def apply(self, model: keras.Model, inputs: Any = None) -> PrecisionReport:
        """Sets the dtype policy of every layer of `model`, nested ones included.

        Works on Sequential, functional and subclassed models, built or not;
        applying again replaces what an earlier apply set. The model's own
        policy is left as it is.

        Args:
            model: The model. Its variables must be float32 (built under
                float32 or a `mixed_*` policy).
            inputs: What a built model is traced on to report each layer's
                output dtype (`report.precision_report`): example inputs or
                their specs; default a functional or Sequential model's own.
                A model not built yet is not traced.

        Returns:
            The precision report of `model` (`report.precision_report`), with
            what decided each layer and why, and the unmatched and shadowed
            rules.

        Raises:
            UserInputError: If the model has float16 or bfloat16 variables.
        """
        for variable in model.weights:
            if variable.dtype in ("float16", "bfloat16"):
                raise UserInputError(
                    f"model '{model.name}': variable '{variable.path}' is {variable.dtype}; "
                    "a manifest keeps variables float32. Allowed: a model built under "
                    "float32, mixed_float16 or mixed_bfloat16"
                )
        entries = list(iter_layer_paths(model))
        application = _Application(self, _output_layers(model), entries)
        if any(rule.policy == FLOAT8 for rule in self.rules):
            # Checked whole before any policy is set, so an error changes nothing.
            application.check_float8(entries)
        units = list(_units(entries))
        decisions = {}
        for unit in units:
            decisions.update(application.apply_to_unit(unit))
        float8 = [path for path, decision in decisions.items() if decision.policy == FLOAT8]
        if float8:
            to_float8(model, float8)
            for unit in units:  # Again: a policy map now holds each one's float8 policy.
                application.apply_to_unit(unit)
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
                _rule_label(index, rule)
                for index, rule in enumerate(self.rules)
                if index not in matched
            ),
            shadowed_rules=tuple(
                _rule_label(index, self.rules[index]) for index in sorted(matched - deciding)
            ),
        )


def _rule_label(index: int, rule: Rule) -> str:
    return f"rules[{index}] ({rule.match_text})"


def _check_keys(values: Any, allowed: tuple[str, ...], required: tuple[str, ...], where: str):
    """Checks that `values` is an object with only `allowed` and all `required` keys."""
    if not isinstance(values, Mapping):
        raise UserInputError(
            f"{where + ': ' if where else ''}must be a JSON object, received {_shown(values)}"
        )
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


def _shown(value: Any) -> str:
    """`value` as JSON text, for messages (`repr` for what JSON cannot hold)."""
    return json.dumps(value, default=repr)


def _parse_rule(values: Any, where: str) -> Rule:
    _check_keys(values, _RULE_KEYS, ("match", "policy"), where)
    _check_keys(values["match"], _MATCH_KEYS, (), f"{where}.match")
    try:
        return Rule(
            policy=values["policy"],
            path=values["match"].get("path"),
            layer_class=values["match"].get("class"),
            reason=values.get("reason"),
        )
    except UserInputError as error:
        raise UserInputError(f"{where}.{error}") from None


@dataclasses.dataclass(frozen=True)
class _Decision:
    policy: str
    decided_by: str
    reason: str | None = None
    matched: tuple[int, ...] = ()  # indices of all rules that match the layer


@dataclasses.dataclass(frozen=True)
class _Unit:
    """A layer whose config its model stores, with the layers under it."""

    entry: LayerPath

    @property
    def model_prefix(self) -> str:
        """The path (with "/") of the model holding its config, which Keras
        leaves out of the paths of a loaded model's layers."""
        model_path = self.entry.models[-1][0]
        return model_path + "/" if model_path else ""

    def members(self) -> Iterator[LayerPath]:
        """The unit and, unless it is a model (whose layers are units), the
        layers under it."""
        yield self.entry
        if not isinstance(self.entry.layer, keras.Model):
            for path, layer in iter_layers(self.entry.layer, prefix=self.entry.path + "/"):
                yield LayerPath(path, layer, self.entry.models)


def _units(entries: list[LayerPath]) -> Iterator[_Unit]:
    """The layers of a model, and of the models among them, recursively."""
    model_paths = {""}
    for entry in entries:
        if entry.path.rpartition("/")[0] in model_paths:
            yield _Unit(entry)
            if isinstance(entry.layer, keras.Model):
                model_paths.add(entry.path)


class _Application:
    """Decides and sets policies for one `apply`; build hooks keep it alive."""

    def __init__(
        self,
        manifest: PrecisionManifest,
        output_layers: list[keras.layers.Layer],
        entries: list[LayerPath],
    ):
        self._manifest = manifest
        self._output_layers = output_layers
        # A layer found at several paths is tried in the forms of all of them.
        self._forms: dict[int, tuple[str, ...]] = {}
        for entry in entries:
            self._forms[id(entry.layer)] = (*self._forms.get(id(entry.layer), ()), *entry.forms)

    def apply_to_unit(self, unit: _Unit) -> dict[str, _Decision]:
        """Sets the policies of `unit`'s members; returns `{path: decision}`."""
        decisions = {}
        policies = {}
        for entry in unit.members():
            layer = entry.layer
            decision = self._decide(entry)
            policies[entry.path] = policy = self._policy(entry, decision)
            compat.replace_dtype_policy(layer, policy)
            if not layer.built:
                _call_after_build(layer, functools.partial(self.apply_to_unit, unit))
            decisions[entry.path] = decision
        unit_policy = policies[unit.entry.path]
        # Keyed by the path Keras gives each layer when its model is loaded.
        policy_map = {
            entry.path.removeprefix(unit.model_prefix): policies[entry.path]
            for entry in unit.members()
            if not (entry.layer.built and entry.layer.path is None)
        }
        if any(policy.name != unit_policy.name for policy in policy_map.values()):
            compat.replace_dtype_policy(
                unit.entry.layer,
                keras.dtype_policies.DTypePolicyMap(
                    default_policy=unit_policy, policy_map=policy_map
                ),
            )
        return decisions

    def check_float8(self, entries: list[LayerPath]) -> None:
        """Raises unless every layer a float8 rule decides can train in float8 now.

        A float8 layer must exist and be built (Keras quantizes its variables),
        so every layer must be: a layer not built yet may create the layers a
        float8 rule is meant for (an attention's projections) only later.
        """
        for entry in entries:
            if not entry.layer.built:
                raise UserInputError(
                    f"layer '{entry.path}': not built, and the manifest has float8 rules, "
                    "which need every layer built (a layer creates some of its sublayers "
                    "when it is built). Build the model (call it on a batch) before "
                    "applying the manifest"
                )
            if self._decide(entry).policy == FLOAT8:
                check_float8_layer(entry.path, entry.layer)

    def _policy(self, entry: LayerPath, decision: _Decision) -> keras.DTypePolicy:
        """The policy object a decision gives the layer at `entry`.

        A float8 layer keeps the one Keras' quantization gave it
        (`float8_from_<default>`, holding its float8 state); one not yet in
        float8 gets the manifest's default, which `apply` then quantizes.
        """
        if decision.policy != FLOAT8:
            return keras.DTypePolicy(decision.policy)
        check_float8_layer(entry.path, entry.layer)
        if is_float8(entry.layer):
            return entry.layer.dtype_policy
        return keras.DTypePolicy(self._manifest.default)

    def _decide(self, entry: LayerPath) -> _Decision:
        layer = entry.layer
        forms = self._forms.get(id(layer)) or entry.forms
        rules = self._manifest.rules
        matched = tuple(index for index, rule in enumerate(rules) if rule.matches(forms, layer))
        if matched:
            rule = rules[matched[0]]
            return _Decision(rule.policy, _rule_label(matched[0], rule), rule.reason, matched)
        if self._manifest.safe_defaults:
            if any(_NORMALIZATION_CLASS.fullmatch(cls.__name__) for cls in type(layer).__mro__):
                return _safe_default("normalization")
            if any(layer is output for output in self._output_layers):
                return _safe_default("model output")
        return _Decision(self._manifest.default, "default")


def _safe_default(kind: str) -> _Decision:
    return _Decision("float32", f"safe default: {kind}", SAFE_DEFAULTS[kind])


def _output_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers whose outputs are `model`'s outputs; see "model output" above."""
    if isinstance(model, keras.Sequential):
        producers = model.layers[-1:]
    elif getattr(model, "outputs", None):
        outputs = keras.tree.flatten(model.outputs)
        producers = [compat.producing_layer(output) for output in outputs]
    else:
        producers = [layer for layer in model.layers if layer.weights or not layer.built][-1:]
    layers = []
    for producer in producers:
        layers.extend(_output_layers(producer) if isinstance(producer, keras.Model) else [producer])
    return layers


def _call_after_build(layer: keras.layers.Layer, callback: Callable[[], object]) -> None:
    """Calls `callback()` once `layer` is built; a later call replaces `callback`.

    Keras has no hook after `build`, which creates some layers' sublayers
    (MultiHeadAttention's projections), so the layer's `build` is wrapped.
    """
    if hasattr(layer.build, "after_build"):
        layer.build.after_build = callback
        return
    build = layer.build

    @functools.wraps(build)
    def build_then_call_back(*args, **kwargs):
        build(*args, **kwargs)
        layer.build = build
        build_then_call_back.after_build()

    build_then_call_back.after_build = callback
    layer.build = build_then_call_back

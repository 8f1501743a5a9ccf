"""Setting a manifest's decisions on layers so that they survive saving and building.

A top-level layer whose sublayers differ from it gets a `DTypePolicyMap`; an unbuilt layer
decides its sublayers when built; a layer set apart from the block calling it may hand its
outputs back in the block's dtype (`hand_back`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import keras

from mpt_keras import compat
from mpt_keras.keras_bridge.layer_paths import LayerPath, iter_layers
from mpt_keras.precision.decisions import Decider, Decision, is_normalization
from mpt_keras.precision.float8 import check_float8_layer, is_float8
from mpt_keras.precision.hand_back import HandBack, hand_back
from mpt_keras.precision.names import FLOAT8


@dataclasses.dataclass(frozen=True)
class Unit:
    """A layer whose config its model stores, with the layers under it."""

    entry: LayerPath

    @property
    def model_prefix(self) -> str:
        """The path (with "/") of the model holding its config; a loaded model's layer
        paths leave it out."""
        model_path = self.entry.models[-1][0]
        return model_path + "/" if model_path else ""

    def members(self) -> Iterator[LayerPath]:
        """The unit and, unless it is a model (whose layers are units), the layers under it."""
        yield self.entry
        if not isinstance(self.entry.layer, keras.Model):
            for path, layer in iter_layers(self.entry.layer, prefix=self.entry.path + "/"):
                yield LayerPath(path, layer, self.entry.models)


def units(entries: list[LayerPath]) -> Iterator[Unit]:
    """The layers of a model, and of the models among them, recursively."""
    model_paths = {""}
    for entry in entries:
        if entry.path.rpartition("/")[0] in model_paths:
            yield Unit(entry)
            if isinstance(entry.layer, keras.Model):
                model_paths.add(entry.path)


class Application:
    """Decides and sets policies for one `apply`; build hooks keep it alive."""

    def __init__(self, decider: Decider, default: str):
        """Args: `default`, the manifest's default (a float8 layer computes in it)."""
        self.decider = decider
        self._default = default
        # Each layer's caller by id: the first found, None once another is (a shared layer).
        self._callers: dict[int, keras.layers.Layer | None] = {}

    def apply_to_unit(self, unit: Unit) -> dict[str, Decision]:
        """Sets the policies of `unit`'s members; returns `{path: decision}`."""
        decisions = {}
        policies = {}
        for entry in unit.members():
            layer = entry.layer
            decision = self.decider.decide(entry)
            policies[entry.path] = policy = self._policy(entry, decision)
            compat.replace_dtype_policy(layer, policy)
            if not layer.built:
                call_after_build(layer, functools.partial(self.apply_to_unit, unit))
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
        members = {entry.path: entry.layer for entry in unit.members()}
        for entry in unit.members():
            # The layer whose `call` calls it: its model's, for the unit itself.
            caller = members.get(entry.path.rpartition("/")[0], entry.models[-1][1])
            hand_back(entry.layer, self._hand_back_to(entry.layer, caller))
        return decisions

    def planned_policy(self, entry: LayerPath) -> keras.DTypePolicy:
        """The policy `apply_to_unit` would give `entry`'s layer, setting nothing."""
        return self._policy(entry, self.decider.decide(entry))

    def _hand_back_to(
        self, layer: keras.layers.Layer, caller: keras.layers.Layer
    ) -> HandBack | None:
        """What `layer` hands its outputs back to, where `caller`'s own `call` meets them
        in raw ops (a graph's next layer casts them itself; the loss reads a model output
        as it is): a normalization's, and a model output's sublayers' widened. A layer
        several layers call (shared) hands back to none: one dtype cannot serve them all."""
        if self._callers.setdefault(id(layer), caller) is not caller:
            self._callers[id(layer)] = None  # Shared, for good.
        if self._callers[id(layer)] is None or self.decider.is_model_output(layer):
            return None
        if compat.runs_graph(caller):
            return None
        if is_normalization(layer):
            return HandBack(caller)
        if self.decider.is_model_output(caller):
            return HandBack(caller, widen_only=True)
        return None

    def _policy(self, entry: LayerPath, decision: Decision) -> keras.DTypePolicy:
        """A float8 layer keeps its `float8_from_<default>` policy (holding its float8
        state); one not yet float8 gets the default until `apply` quantizes it."""
        if decision.policy != FLOAT8:
            return keras.DTypePolicy(decision.policy)
        check_float8_layer(entry.path, entry.layer)
        if is_float8(entry.layer):
            return entry.layer.dtype_policy
        return keras.DTypePolicy(self._default)


def call_after_build(layer: keras.layers.Layer, callback: Callable[[], object]) -> None:
    """Calls `callback()` once `layer` is built; a later call replaces `callback`.

    Keras has no hook after `build`, which creates some sublayers (MultiHeadAttention's
    projections), so `build` is wrapped.
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

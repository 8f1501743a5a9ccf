"""Which policy a manifest gives each layer, and why: first matching rule, safe default, default.

The float8 check runs whole before `apply` sets any policy, so an error changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from mpt_keras import compat
from mpt_keras.errors import UserInputError, describe_error
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import LayerPath, iter_layers
from mpt_keras.precision.float8 import check_float8_layer
from mpt_keras.precision.names import FLOAT8
from mpt_keras.precision.rules import Rule, rule_label

SAFE_DEFAULTS = {
    "normalization": "mean and variance round badly in float16/bfloat16",
    "model output": "feeds the loss: softmax and log over- or underflow in low precision",
}

_NORMALIZATION_CLASS = re.compile(r".*Norm(alization)?|RMSNorm.*")
_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A layer's policy name, what decided it and why; `matched`: every rule matching it."""

    policy: str
    decided_by: str
    reason: str | None = None
    matched: tuple[int, ...] = ()


class Decider:
    """Decides the layers of one model by a manifest's rules, safe defaults and default."""

    def __init__(
        self,
        rules: Sequence[Rule],
        default: str,
        safe_defaults: bool,
        model: keras.Model,
        entries: Sequence[LayerPath],
        inputs: Any = None,
    ):
        """Args: `entries`, every layer of `model` at each of its paths; `inputs`, a batch on
        which a subclassed model shows which layers make its outputs (`output_layers`)."""
        self._rules = tuple(rules)
        self._default = default
        self._safe_defaults = safe_defaults
        self._output_layers = output_layers(model, inputs)
        # A layer found at several paths is tried in the forms of all of them: one policy.
        self._forms: dict[int, tuple[str, ...]] = {}
        for entry in entries:
            self._forms[id(entry.layer)] = (*self._forms.get(id(entry.layer), ()), *entry.forms)

    def decide(self, entry: LayerPath) -> Decision:
        """The first matching rule's policy; else a safe default; else the default."""
        layer = entry.layer
        forms = self._forms.get(id(layer)) or entry.forms
        matched = tuple(
            index for index, rule in enumerate(self._rules) if rule.matches(forms, layer)
        )
        if matched:
            rule = self._rules[matched[0]]
            return Decision(rule.policy, rule_label(matched[0], rule), rule.reason, matched)
        if self._safe_defaults:
            if is_normalization(layer):
                return _safe_default("normalization")
            if self.is_model_output(layer):
                return _safe_default("model output")
        return Decision(self._default, "default")

    def is_model_output(self, layer: keras.layers.Layer) -> bool:
        """Whether `layer`'s outputs are the model's (through nested models)."""
        return any(layer is output for output in self._output_layers)

    def check_float8(self, entries: Sequence[LayerPath]) -> None:
        """Raises `UserInputError` naming the first layer not built, or decided float8 and
        unable to train in it. Every layer must be built: an unbuilt one may later create
        the layers a float8 rule is meant for (an attention's projections)."""
        for entry in entries:
            if not entry.layer.built:
                raise UserInputError(
                    f"layer '{entry.path}': not built, and the manifest has float8 rules, "
                    "which need every layer built (a layer creates some of its sublayers "
                    "when it is built). Build the model (call it on a batch) before "
                    "applying the manifest"
                )
            if self.decide(entry).policy == FLOAT8:
                check_float8_layer(entry.path, entry.layer)


def is_normalization(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s class, or a base, is named `*Normalization`, `*Norm` or `RMSNorm*`."""
    return any(_NORMALIZATION_CLASS.fullmatch(cls.__name__) for cls in type(layer).__mro__)


def _safe_default(kind: str) -> Decision:
    return Decision("float32", f"safe default: {kind}", SAFE_DEFAULTS[kind])


def output_layers(model: keras.Model, inputs: Any = None) -> list[keras.layers.Layer]:
    """The layers whose outputs are `model`'s outputs, through nested models.

    A subclassed model's, which has no graph: the own layers whose calls return the tensors
    it returns on `inputs` (each head of several), once built; for a tensor an operation
    makes, or without that call, also its last own layer with weights or not yet built.
    """
    if isinstance(model, keras.Sequential):
        producers = model.layers[-1:]
    elif getattr(model, "outputs", None):
        outputs = keras.tree.flatten(model.outputs)
        producers = [compat.producing_layer(output) for output in outputs]
    else:
        producers, complete = _returning_layers(model, inputs)
        if not complete:
            last = [layer for layer in model.layers if layer.weights or not layer.built][-1:]
            producers += [layer for layer in last if all(layer is not p for p in producers)]
    layers = []
    for producer in producers:
        layers.extend(output_layers(producer) if isinstance(producer, keras.Model) else [producer])
    return layers


def _returning_layers(model: keras.Model, inputs: Any) -> tuple[list[keras.layers.Layer], bool]:
    """`(own layers whose call returned a tensor model(inputs) returns, whether every
    returned tensor was one)`, by identity, in eager calls; `([], False)` for a model not
    built or without concrete `inputs` (a spec runs no call)."""
    leaves = keras.tree.flatten(inputs)
    if not model.built or not leaves or not all(_concrete(leaf) for leaf in leaves):
        return [], False  # A call would build it before its layers have their policies.
    made: dict[int, tuple[Any, keras.layers.Layer]] = {}

    def keeping(layer: keras.layers.Layer, call: Callable[..., Any]) -> Callable[..., Any]:
        def kept(*args: Any, **kwargs: Any) -> Any:
            outputs = call(*args, **kwargs)
            for tensor in keras.tree.flatten(outputs):
                # Its maker, not a Dropout handing it on as it is; the tensor too: its id
                # stays its own.
                made.setdefault(id(tensor), (tensor, layer))
            return outputs

        return kept

    own = [layer for _, layer in iter_layers(model)]
    try:
        with (
            calls_wrapped(model.layers, keeping),
            compat.call_records_restored([model, *own]),
            keras.StatelessScope(),  # Nothing the call assigns or adds as a loss is kept.
        ):
            returned = keras.tree.flatten(model(inputs, training=False))
    except Exception as error:  # Its last layer stands for its outputs, as without inputs.
        _LOGGER.warning(
            "Model %s: not called to find the layers making its outputs (%s)",
            model.name,
            describe_error(error),
        )
        return [], False
    producers: list[keras.layers.Layer] = []
    for tensor in returned:
        tensor_and_layer = made.get(id(tensor))
        if tensor_and_layer is None or tensor_and_layer[0] is not tensor:
            return producers, False
        if all(tensor_and_layer[1] is not layer for layer in producers):
            producers.append(tensor_and_layer[1])
    return producers, True


def _concrete(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (
        keras.ops.is_tensor(value) and not isinstance(value, keras.KerasTensor)
    )

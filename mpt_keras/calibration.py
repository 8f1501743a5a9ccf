"""Calibration: measure a model in float32 on real batches, then decide each layer's precision.

`calibrate` runs a short float32 pass over `steps` real batches and records:

    activations  per layer whose output the model's graph exposes: max, p99,
                 p99.9 and p99.99 of |output|, and among its non-zero values
                 the fractions above the float16 max (65504), below the float16
                 smallest normal (2**-14, 6.1e-5) and below its smallest
                 subnormal (2**-24, 6.0e-8, which rounds to zero).
    gradients    per trainable variable, the gradient of the loss times the
                 loss scale a float16 run starts with (`initial_scale`,
                 2**15 by default): max |g|, and among the non-zero values the
                 fractions that would underflow float16 (|g * scale| < 2**-24)
                 or overflow it (> 65504).
    sensitivity  per layer, the relative error ||y_low - y|| / ||y|| of its
                 output when it alone computes in float16 (`mixed_float16`)
                 or bfloat16 (`mixed_bfloat16`), all other layers float32.

Sensitivity is measured clone-free: the layer is called alone on the float32
inputs recorded for it, after a `PrecisionManifest` gave it (and its nested
layers other than safe-default ones, exactly as the resulting manifest would)
the low-precision policy. Each layer is run once per batch and policy, so the
cost is about `2 * steps` forward passes.

Which layers. The top-level layers of a functional or Sequential model (the
ones whose outputs its graph exposes; a nested block such as a DecoderBlock is
one unit with its sublayers). A subclassed model has no graph to read
intermediate outputs from and is refused.

Decisions (`CalibrationThresholds`), per layer:

    mixed_float16   activation max <= 65504 / float16_headroom, at most
                    `max_underflow_fraction` of its non-zero activations and of
                    its variables' scaled gradients underflow float16, and the
                    float16 error <= `max_float16_error`;
    mixed_bfloat16  otherwise, if the bfloat16 error <= `max_bfloat16_error`;
    float32         otherwise.

Gradient overflow at the initial scale is recorded but decides nothing: the
dynamic loss scale backs off on the first overflowing steps. The manifest's
`default` is the policy most layers got; every other layer gets exact-path
rules with the reason and its numbers. Safe defaults stay on, so the model
outputs and normalization layers stay float32 whatever their numbers (which
are still recorded).

Example:

    result = calibrate(model, (features, labels), keras.losses.MeanSquaredError(), steps=4)
    result.manifest.default            # 'mixed_float16'
    result.statistics["layers"]["big"]["reason"]
    # 'activation max 1.2e+06 > 8188 (float16 max 65504 / headroom 8) -> mixed_bfloat16'
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.errors import UserInputError
from mpt_keras.manifest import PrecisionManifest, Rule
from mpt_keras.policies import iter_layers

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
LOW_PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16")
_QUANTILES = {"p99": 0.99, "p99.9": 0.999, "p99.99": 0.9999}


def _is_positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclasses.dataclass(frozen=True)
class CalibrationThresholds:
    """When a layer may compute in float16 or bfloat16; see the module docstring.

    Attributes:
        float16_headroom: float16 only if the largest activation seen times
            this still fits 65504: unseen batches run larger than the few
            calibrated, and one value above the max is inf.
        max_underflow_fraction: The most of a layer's non-zero activations,
            or of its variables' scaled gradients, that may round to zero in
            float16 (below 2**-24).
        max_float16_error: The largest relative output error in float16; its
            rounding unit is 4.9e-4, so 1e-2 means a 20-fold amplification.
        max_bfloat16_error: The same for bfloat16 (rounding unit 3.9e-3).

    Example:

        strict = CalibrationThresholds(max_float16_error=1e-3)
        result = calibrate(model, data, loss, thresholds=strict)
    """

    float16_headroom: float = 8.0
    max_underflow_fraction: float = 0.01
    max_float16_error: float = 1e-2
    max_bfloat16_error: float = 5e-2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _is_positive_number(value):
                raise UserInputError(
                    f"CalibrationThresholds.{field.name}: must be a number > 0, received {value!r}"
                )
        if self.float16_headroom < 1:
            raise UserInputError(
                "CalibrationThresholds.float16_headroom: must be >= 1, "
                f"received {self.float16_headroom!r}"
            )


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """What `calibrate` measured and the manifest it decided.

    Attributes:
        statistics: JSON-ready: `model`, `steps`, `seed`, `initial_scale`,
            `thresholds`, `default`, per layer path (`layers`) its class,
            `activations`, `errors` (per low-precision policy; `null` when the
            output was not finite), `policy` and `reason`, and per variable
            path (`gradients`) its `layer` and gradient figures.
        manifest: The decided precision manifest, a reason on every rule.

    Example:

        result = calibrate(model, data, loss, steps=4)
        result.manifest.apply(model)
        open("stats.json", "w").write(result.to_json())
    """

    statistics: dict[str, Any]
    manifest: PrecisionManifest

    def to_json(self) -> str:
        """The statistics as indented JSON text."""
        return json.dumps(self.statistics, indent=2) + "\n"


def calibrate(
    model: keras.Model,
    data: tf.data.Dataset | tuple[np.ndarray, np.ndarray],
    loss: Callable[[Any, Any], Any],
    steps: int = 8,
    seed: int = 0,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
    initial_scale: float = 2.0**15,
    batch_size: int = 32,
) -> CalibrationResult:
    """Measures `model` in float32 on `steps` batches and decides each layer's policy.

    The layers' policies are float32 during the pass and restored afterwards;
    weights are not changed.

    Args:
        model: A built functional or Sequential model.
        data: A `tf.data.Dataset` of `(x, y)` batches (the first `steps` are
            used), or a tuple `(x, y)` of arrays, shuffled with `seed` and cut
            into `steps` batches of `batch_size`.
        loss: `loss(y_true, y_pred)`, a scalar: the gradients are its.
        steps: Batches to measure, at least 1.
        seed: Shuffling seed for array data.
        thresholds: The decision thresholds.
        initial_scale: The loss scale a float16 run starts with.
        batch_size: Examples per batch, for array data.

    Returns:
        The statistics and the manifest; the same data and seed give the
        same result.

    Raises:
        UserInputError: For a subclassed or unbuilt model, bad `steps`,
            `batch_size` or `initial_scale`, or data without a batch.
    """
    if not isinstance(steps, int) or steps < 1:
        raise UserInputError(f"steps: must be an integer >= 1, received {steps!r}")
    if not _is_positive_number(initial_scale):
        raise UserInputError(f"initial_scale: must be a number > 0, received {initial_scale!r}")
    nodes = _graph_nodes(model)
    batches = list(_batches(data, steps, seed, batch_size))
    saved_policies = [(layer, layer.dtype_policy) for _, layer in iter_layers(model)]
    try:
        float32 = PrecisionManifest(default="float32").apply(model)
        return _Calibration(model, nodes, float32, thresholds, initial_scale).run(
            batches, loss, seed
        )
    finally:
        for layer, policy in saved_policies:
            # The public setter would write into a DTypePolicyMap in place.
            layer._dtype_policy = policy


def format_calibration_table(statistics: dict[str, Any]) -> str:
    """The layers of calibration statistics as an aligned text table."""
    columns = ("path", "class", "act_max", "fp16_err", "bf16_err", "policy", "reason")
    rows = [columns]
    for path, layer in statistics["layers"].items():
        errors = layer["errors"]
        rows.append(
            (
                path,
                layer["class"],
                _short(layer["activations"]["max"]),
                _short(errors["mixed_float16"]),
                _short(errors["mixed_bfloat16"]),
                layer["policy"],
                layer["reason"],
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(len(columns))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class _Node:
    """One call of a top-level layer in the model's graph."""

    path: str
    layer: keras.layers.Layer
    node: Any  # keras.src.ops.node.Node: its arguments and output tensors


def _graph_nodes(model: keras.Model) -> list[_Node]:
    """The calls of `model`'s top-level layers, in the order its graph runs them."""
    if not model.built or not getattr(model, "outputs", None):
        raise UserInputError(
            f"model '{model.name}': {type(model).__name__} has no graph of layer outputs "
            "(subclassed, or not built). Allowed: a built functional or Sequential model"
        )
    paths = {id(layer): path for path, layer in iter_layers(model) if "/" not in path}
    nodes: list[_Node] = []
    seen: set[int] = set()

    def visit(tensor) -> None:
        operation, node_index, _ = tensor._keras_history
        node = operation._inbound_nodes[node_index]
        if id(node) in seen:
            return
        seen.add(id(node))
        for parent in node.input_tensors:
            visit(parent)
        if id(operation) in paths:
            nodes.append(_Node(paths[id(operation)], operation, node))

    for output in keras.tree.flatten(model.outputs):
        visit(output)
    return nodes


def _batches(data, steps: int, seed: int, batch_size: int) -> Iterator[tuple[Any, Any]]:
    if isinstance(data, tf.data.Dataset):
        count = 0
        for features, labels in data.take(steps):
            count += 1
            yield features, labels
        if not count:
            raise UserInputError("data: the dataset yielded no batch. Allowed: (x, y) batches")
        return
    if not (isinstance(data, tuple) and len(data) == 2):
        raise UserInputError(
            f"data: received {type(data).__name__}. Allowed: a tf.data.Dataset of (x, y) "
            "batches or a tuple (x, y) of arrays"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserInputError(f"batch_size: must be an integer >= 1, received {batch_size!r}")
    features, labels = (np.asarray(array) for array in data)
    if not len(features) or len(features) != len(labels):
        raise UserInputError(
            f"data: received {len(features)} examples and {len(labels)} labels. "
            "Allowed: as many labels as examples, at least one"
        )
    order = np.random.default_rng(seed).permutation(len(features))
    # Wrapped around when the arrays hold fewer than steps * batch_size examples.
    indices = np.resize(order, steps * batch_size).reshape(steps, batch_size)
    for batch in indices:
        yield features[batch], labels[batch]


class _Calibration:
    """The measurements of one `calibrate` call."""

    def __init__(self, model, nodes, float32_report, thresholds, initial_scale):
        self._model = model
        self._nodes = nodes
        self._thresholds = thresholds
        self._scale = initial_scale
        decided_by = {layer.path: layer.decided_by for layer in float32_report.layers}
        self._safe_default = {
            node.path: decided_by[node.path]
            for node in nodes
            if decided_by[node.path].startswith("safe default")
        }
        # Nested layers decided by a safe default or following their unit take
        # no rule, so they stay as the safe defaults and Keras have them.
        self._members = {
            node.path: [node.path]
            + [
                path
                for path, _ in iter_layers(node.layer, prefix=node.path + "/")
                if decided_by[path] == "default"
            ]
            for node in nodes
        }
        tensors = {}
        for node in nodes:
            for tensor in (*node.node.arguments.keras_tensors, *node.node.output_tensors):
                tensors[id(tensor)] = tensor
        self._tensor_ids = list(tensors)
        self._probe = keras.Model(model.input, list(tensors.values()))

    def run(self, batches, loss, seed: int) -> CalibrationResult:
        recorded = []
        for features, _ in batches:
            values = self._probe(features, training=False)
            recorded.append(dict(zip(self._tensor_ids, values)))
        references = {
            node.path: [self._outputs(node, values) for values in recorded] for node in self._nodes
        }
        layers = {}
        for node in self._nodes:
            magnitudes = np.concatenate(
                [np.abs(output).ravel() for output in references[node.path]]
            )
            layers[node.path] = {
                "class": type(node.layer).__name__,
                "activations": _activation_statistics(magnitudes),
                "errors": {
                    policy: self._error(node, policy, recorded, references[node.path])
                    for policy in LOW_PRECISION_POLICIES
                },
            }
        gradients = self._gradient_statistics(batches, loss)
        for node in self._nodes:
            layer = layers[node.path]
            layer_gradients = {
                name: figures
                for name, figures in gradients.items()
                if figures["layer"] == node.path
            }
            layer["policy"], layer["reason"] = self._decide(node.path, layer, layer_gradients)
        default = collections.Counter(
            layer["policy"] for path, layer in layers.items() if path not in self._safe_default
        ).most_common(1)
        default_policy = default[0][0] if default else "mixed_float16"
        rules = []
        for path, layer in layers.items():
            if path in self._safe_default or layer["policy"] == default_policy:
                continue
            rules.extend(self._rules(path, layer["policy"], layer["reason"]))
        statistics = {
            "model": self._model.name,
            "steps": len(batches),
            "seed": seed,
            "initial_scale": self._scale,
            "thresholds": dataclasses.asdict(self._thresholds),
            "default": default_policy,
            "layers": layers,
            "gradients": gradients,
        }
        return CalibrationResult(statistics, PrecisionManifest(default_policy, tuple(rules)))

    def _rules(self, path: str, policy: str, reason: str | None) -> list[Rule]:
        members = self._members[path]
        return [Rule(policy, path=members[0], reason=reason)] + [
            Rule(policy, path=member, reason=f"follows {path}") for member in members[1:]
        ]

    def _outputs(self, node: _Node, values: dict[int, Any]) -> np.ndarray:
        return _flat_float32(values[id(tensor)] for tensor in node.node.output_tensors)

    def _error(self, node: _Node, policy: str, recorded, references) -> float | None:
        PrecisionManifest("float32", tuple(self._rules(node.path, policy, None))).apply(self._model)
        try:
            squared_error = squared_reference = 0.0
            for values, reference in zip(recorded, references):
                args, kwargs = node.node.arguments.fill_in(values)
                low = _flat_float32(keras.tree.flatten(node.layer(*args, **kwargs)))
                squared_error += float(np.sum(np.square(low - reference, dtype=np.float64)))
                squared_reference += float(np.sum(np.square(reference, dtype=np.float64)))
        finally:
            PrecisionManifest("float32").apply(self._model)
        if not math.isfinite(squared_error):
            return None
        return math.sqrt(squared_error / squared_reference) if squared_reference else 0.0

    def _gradient_statistics(self, batches, loss) -> dict[str, dict[str, Any]]:
        owners = {}
        for node in self._nodes:
            for variable in node.layer.trainable_variables:
                owners.setdefault(id(variable), node.path)
        variables = self._model.trainable_variables
        magnitudes = [[] for _ in variables]
        for features, labels in batches:
            with tf.GradientTape() as tape:
                value = loss(labels, self._model(features, training=False))
            for index, gradient in enumerate(tape.gradient(value, variables)):
                if gradient is not None:
                    magnitudes[index].append(np.abs(tf.convert_to_tensor(gradient).numpy()).ravel())
        statistics = {}
        for variable, pieces in zip(variables, magnitudes):
            values = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
            scaled = values[values > 0].astype(np.float64) * self._scale
            statistics[variable.path] = {
                "layer": owners.get(id(variable)),
                "max": _number(values.max()) if values.size else 0.0,
                "nonzero_fraction": _fraction(scaled.size, values.size),
                "underflow_fraction": _fraction(
                    np.count_nonzero(scaled < FLOAT16_SMALLEST_SUBNORMAL), scaled.size
                ),
                "overflow_fraction": _fraction(np.count_nonzero(scaled > FLOAT16_MAX), scaled.size),
            }
        return statistics

    def _decide(self, path: str, layer, gradients) -> tuple[str, str]:
        if path in self._safe_default:
            return "float32", self._safe_default[path]
        limits = self._thresholds
        activations = layer["activations"]
        fits = FLOAT16_MAX / limits.float16_headroom
        problems = []
        if activations["max"] > fits:
            problems.append(
                f"activation max {activations['max']:.3g} > {fits:.0f} "
                f"(float16 max 65504 / headroom {limits.float16_headroom:g})"
            )
        if activations["below_subnormal_fraction"] > limits.max_underflow_fraction:
            problems.append(
                f"{activations['below_subnormal_fraction']:.1%} of activations < float16 "
                f"subnormal min 6e-08 (> {limits.max_underflow_fraction:.1%})"
            )
        name = max(gradients, key=lambda name: gradients[name]["underflow_fraction"], default=None)
        if name and gradients[name]["underflow_fraction"] > limits.max_underflow_fraction:
            problems.append(
                f"{gradients[name]['underflow_fraction']:.1%} of {name} gradients x "
                f"{self._scale:g} < "
                f"float16 subnormal min 6e-08 (> {limits.max_underflow_fraction:.1%})"
            )
        float16_error = _or_inf(layer["errors"]["mixed_float16"])
        bfloat16_error = _or_inf(layer["errors"]["mixed_bfloat16"])
        if not problems:
            if float16_error <= limits.max_float16_error:
                return "mixed_float16", (
                    f"range fits float16, error {float16_error:.2g} <= "
                    f"{limits.max_float16_error:g} -> mixed_float16"
                )
            problems.append(f"float16 error {float16_error:.2g} > {limits.max_float16_error:g}")
        if bfloat16_error <= limits.max_bfloat16_error:
            return "mixed_bfloat16", "; ".join(problems) + " -> mixed_bfloat16"
        return "float32", (
            "; ".join(problems)
            + f"; bfloat16 error {bfloat16_error:.2g} > {limits.max_bfloat16_error:g} -> float32"
        )


def _activation_statistics(magnitudes: np.ndarray) -> dict[str, float | None]:
    nonzero = magnitudes[magnitudes > 0]
    figures: dict[str, float | None] = {
        "max": _number(magnitudes.max()) if magnitudes.size else 0.0,
    }
    for name, quantile in _QUANTILES.items():
        figures[name] = _number(np.quantile(magnitudes, quantile)) if magnitudes.size else 0.0
    figures["above_float16_max_fraction"] = _fraction(
        np.count_nonzero(nonzero > FLOAT16_MAX), nonzero.size
    )
    figures["below_normal_fraction"] = _fraction(
        np.count_nonzero(nonzero < FLOAT16_SMALLEST_NORMAL), nonzero.size
    )
    figures["below_subnormal_fraction"] = _fraction(
        np.count_nonzero(nonzero < FLOAT16_SMALLEST_SUBNORMAL), nonzero.size
    )
    return figures


def _flat_float32(tensors) -> np.ndarray:
    pieces = [
        np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32"))).ravel()
        for tensor in tensors
        if keras.backend.is_float_dtype(tensor.dtype)
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _fraction(count: int, total: int) -> float:
    return count / total if total else 0.0


def _number(value) -> float | None:
    """A finite float, or None (JSON has no inf or NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def _or_inf(value: float | None) -> float:
    return math.inf if value is None else value


def _short(value: float | None) -> str:
    return "nonfinite" if value is None else f"{value:.3g}"

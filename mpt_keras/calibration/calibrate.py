"""Calibration: measure a model in float32 on real batches, then decide each layer's precision.

One module past 450 lines: what is measured, the decision rule and its
reasons change together, and `calibrate`'s inputs (a model or factory, data,
a loss) are checked where they are used.

`calibrate` runs a short float32 pass over `steps` real batches and records:

    activations  per layer (below: which): max, p99, p99.9 and p99.99 of
                 |output|; among its non-zero values the fractions above the
                 float16 max (65504), below the float16 smallest normal
                 (2**-14, 6.1e-5) and below its smallest subnormal (2**-24,
                 6.0e-8, which rounds to zero); and the fraction of the
                 output's norm in those flushed values, ||flushed|| / ||y||:
                 the relative error flushing to zero alone makes.
    gradients    per trainable variable, its gradient g of the loss (sample
                 weights applied), and g times the loss scale a float16 run
                 starts with (`initial_scale`, 2**15 by default): max |g|,
                 ||g|| (all batches' gradients together), its
                 `nonzero_fraction`, the fraction of ||g|| in entries with
                 |g * scale| < 2**-24, which float16 flushes to zero, and among
                 the non-zero entries the fraction that would overflow
                 float16 (|g * scale| > 65504). Per layer, the same flushed
                 fraction of the norm of its variables' gradients together.
    sensitivity  per layer, the relative error ||y_low - y|| / ||y|| of its
                 output when it alone computes in float16 (`mixed_float16`)
                 or bfloat16 (`mixed_bfloat16`), all other layers float32
                 (a group of tied layers together; none for a layer that
                 only passes its inputs on, or was not called).
    float8       per Dense and EinsumDense, a block's included, in the
                 gradients' pass: the amax of its inputs, kernel and
                 output gradient, and the shares of each that saturate or
                 underflow in e4m3 or e5m2 at the scale Keras' delayed
                 scaling would use (`calibration_float8`).

The activations are recorded as the model runs (each layer's `call` wrapped,
so a layer called twice, as a causal LM's token embedding, is measured on
both calls, and a block's sublayers on their real calls inside it), and
sensitivity is measured clone-free: the layer is called alone on the float32
inputs recorded for it, after it got the low-precision policy, every other
layer float32. Each layer is run once per
batch and policy, so the cost is about `2 * steps` forward passes for each
level of nesting (a block, its attention). The model runs with
`training=False` throughout (no dropout; batch normalization on its moving
statistics), so its weights are left as they were.

Which layers (`calibration_sites`): every layer a manifest rule can name,
down to the sublayers of a keras_hub block (its attention's projections and
softmax, its feed-forward denses and norms), each by its own path; a
functional, Sequential or subclassed model is its layers. A block's own
decision covers only what its `call` computes outside its sublayers. A
layer that only passes its inputs on (Dropout at inference, ReLU, Reshape)
is not measured, and its range alone decides it. Sublayers that must compute
in their block's dtype (what a block adds to its residual stream with `+`)
are tied to it and follow its decision.

Decisions (`CalibrationThresholds`), per layer, or per group of tied layers
on the figures of all its members (its members' reasons: `tied to <path>`):

    mixed_float16   activation max <= 65504 / float16_headroom, float16
                    flushes at most `max_flushed_norm_fraction` of the norm
                    of its activations and of its gradient times the initial
                    scale, and the float16 error <= `max_float16_error`;
    mixed_bfloat16  otherwise, if the bfloat16 error <= `max_bfloat16_error`;
    float32         otherwise.

A layer not measured takes the default, or `mixed_bfloat16` when the
default is `mixed_float16` and its range rules float16 out.

With `float8=True`, a Dense or EinsumDense whose own decision is the
manifest's default and whose shares are within `max_float8_saturated_fraction`
and `max_float8_underflowed_fraction` gets a first rule `float8`, its reason
naming the figures; every other one's reason (in `float8_layers`) says why
not (`calibration_float8`).

Flushing counts what is lost, not how many values are tiny: the key bias of
an attention, whose gradient is zero but for rounding, flushes entirely and
loses nothing of its layer's gradient. Gradient overflow at the initial scale
is recorded but decides nothing: the dynamic loss scale backs off on the
first overflowing steps. The manifest's `default` is the policy most layers
got; every other layer gets exact-path rules (its path, regex-escaped) with
the reason and its numbers. A layer such a rule would also match (a nested
model's layer named like one of the model's own) gets a rule of its own
first, its path with the model's name in front. A layer at two paths (a
shared token embedding) is measured once, at the first. Safe defaults stay
on, so the model outputs and normalization layers stay float32 whatever their
numbers (which are still recorded).

A batch that is not finite in float32 is diagnosed (`diagnose_nonfinite`): a
layer's output that is not finite is an error naming the first such layer,
as no precision mends it; a gradient that is not finite is named in the
statistics' `diagnosis` and the last line of the table.

Example:

    result = calibrate(model, (features, labels), keras.losses.MeanSquaredError(), steps=4)
    result.manifest.default            # 'mixed_float16'
    result.statistics["layers"]["big"]["reason"]
    # 'activation max 1.2e+06 > 8188 (float16 max 65504 / headroom 8) -> mixed_bfloat16'

Why one module: the measurement (one recording forward and backward pass per
batch) and the decision per layer are one procedure whose statistics are
its output; split, each half would carry the other's layout of those
statistics. The manifest it writes, the diagnosis, the layer paths and which
layers are measured (`calibration_sites`) live in their own modules, and so
do the float8 figures with their decision
(`calibration_float8`): recorded in the same backward pass, they and their
rule are a procedure of their own.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.calibration.float8 import (
    FLOAT8_TABLE_COLUMNS,
    Float8Recorder,
    decide_float8,
    float8_table_rows,
    format_figure,
    format_share,
)
from mpt_keras.calibration.sites import (
    CalibrationSites,
    Group,
    flat_float32,
    pass_through_reason,
)
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import first_instance_name, iter_layer_paths, iter_layers
from mpt_keras.precision.float8 import FLOAT8_LAYER_CLASSES, is_float8_state
from mpt_keras.precision.manifest import PrecisionManifest, Rule
from mpt_keras.precision.names import FLOAT8, LOW_PRECISION_POLICIES
from mpt_keras.telemetry.diagnosis import diagnose_nonfinite

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
_QUANTILES = {"p99": 0.99, "p99.9": 0.999, "p99.99": 0.9999}
_MODEL_ALLOWED = "Allowed: a keras.Model, or a function of no arguments returning one"
_DATA_ALLOWED = (
    "Allowed: a tf.data.Dataset of (x, y) or (x, y, sample_weight) batches, or a tuple "
    "(x, y) or (x, y, sample_weight) of arrays; x an array or a dict of arrays"
)


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
        max_flushed_norm_fraction: The largest fraction of the norm of a
            layer's activations, or of its gradient (all its variables'
            together) times the initial loss scale, in values below 2**-24
            that float16 flushes to zero: the relative error flushing alone
            makes. 0.01 loses 1% of the norm.
        max_float16_error: The largest relative output error in float16; its
            rounding unit is 4.9e-4, so 1e-2 means a 20-fold amplification.
        max_bfloat16_error: The same for bfloat16 (rounding unit 3.9e-3).
        max_float8_saturated_fraction: float8 only if at most this share of
            each of a Dense or EinsumDense's inputs, kernel and output
            gradient saturates at the delayed scale (`calibration_float8`).
            A saturated value is clipped to the format's largest, an error
            as large as its excess; delayed scaling saturates the values of
            a step above every amax before it, a few outliers when the
            range is steady: 0.1% allows those, and refuses a layer whose
            amax keeps jumping.
        max_float8_underflowed_fraction: float8 only if at most this share
            of each underflows to zero: 1%, as `max_flushed_norm_fraction`.
            e4m3 spans 2**17.8 below the amax, e5m2 2**31.8; a tensor whose
            values spread wider (small kernel weights beside a large one)
            loses them.

    Example:

        strict = CalibrationThresholds(max_float16_error=1e-3)
        result = calibrate(model, data, loss, thresholds=strict)
    """

    float16_headroom: float = 8.0
    max_flushed_norm_fraction: float = 0.01
    max_float16_error: float = 1e-2
    max_bfloat16_error: float = 5e-2
    max_float8_saturated_fraction: float = 1e-3
    max_float8_underflowed_fraction: float = 1e-2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _is_positive_number(value):
                raise UserInputError(
                    f"CalibrationThresholds.{field.name}: must be a number > 0, received {value!r}"
                )
            if field.name.endswith("_fraction") and value > 1:
                raise UserInputError(
                    f"CalibrationThresholds.{field.name}: must be <= 1 (a share), "
                    f"received {value!r}"
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
            `activations`, `gradients` (`norm` and `flushed_norm_fraction` of
            its variables' gradients together), `errors` (per low-precision
            policy, `null` when the output was not finite; `errors` itself
            null for a layer not measured alone: tied to another, passing its
            inputs on, or not called), `policy` and `reason`, and per
            variable path (`gradients`) its `layer` (the innermost), `max`,
            `norm`, `flushed_norm_fraction`, `nonzero_fraction` and
            `overflow_fraction`; and `diagnosis`, where the first batch whose
            gradients were not finite stopped being finite (`statistics
            batch 2 of 8: first non-finite gradient: dense/kernel`), or null;
            `float8`, whether the manifest has float8 rules, and per Dense or
            EinsumDense path (`float8_layers`) its `class`, `calls`, each
            quantized tensor's `format`, `amax`, `saturated` and
            `underflowed` shares (`calibration_float8`), its `policy` in the
            manifest, whether float8 is `recommended`, and the `reason`.
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
    model_or_factory: keras.Model | Callable[[], keras.Model],
    data: tf.data.Dataset | tuple[Any, ...],
    loss: keras.losses.Loss | Callable[[Any, Any], Any],
    steps: int = 8,
    seed: int = 0,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
    initial_scale: float = 2.0**15,
    batch_size: int = 32,
    float8: bool = False,
) -> CalibrationResult:
    """Measures a model in float32 on `steps` batches and decides a manifest.

    Args:
        model_or_factory: A functional, Sequential or subclassed model with
            float32 variables, or a function of no arguments returning one.
            Its policies and weights are left as they were; one not built
            yet is built on the first batch.
        data: A `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)`
            batches (the first `steps` are read), or a tuple `(x, y)` or
            `(x, y, sample_weight)` of arrays, shuffled with `seed` and cut
            into `steps` batches of `batch_size` (wrapping around if short).
            `x` is what the model takes: an array, or a dict of arrays (a
            keras_hub model's `{"token_ids": ..., "padding_mask": ...}`).
        loss: A `keras.losses.Loss`, or a function `loss(y_true, y_pred)`
            returning a loss per example. Sample weights weigh the losses,
            which are then summed and divided by the batch size, as Keras'
            losses do by default.
        steps: Batches to measure, at least 1.
        seed: Shuffling seed for array data.
        thresholds: The decision thresholds.
        initial_scale: The loss scale a float16 run starts with.
        batch_size: Examples per batch, for array data.
        float8: Give the Dense and EinsumDense layers recommended for float8
            a float8 rule. Off by default: without float8 units (CPUs, GPUs
            before compute capability 8.9) float8 is emulated, and slower.
            Their figures and the recommendation are in the statistics
            either way.

    Returns:
        The statistics and the manifest; the same data and seed give the
        same result.

    Raises:
        UserInputError: For a factory not returning a model, bad `steps`,
            `batch_size`, `initial_scale`, `loss` or `float8`, or bad data.
    """
    if not isinstance(steps, int) or steps < 1:
        raise UserInputError(f"steps: must be an integer >= 1, received {steps!r}")
    if not isinstance(float8, bool):
        raise UserInputError(f"float8: must be True or False, received {float8!r}")
    if not _is_positive_number(initial_scale):
        raise UserInputError(f"initial_scale: must be a number > 0, received {initial_scale!r}")
    loss = _loss(loss)
    model = _model(model_or_factory)
    batches = list(_batches(data, steps, seed, batch_size))
    if not model.built:
        model(batches[0][0], training=False)
    sites = CalibrationSites(model)
    saved_policies = [(layer, layer.dtype_policy) for _, layer in iter_layers(model)]
    try:
        float32 = PrecisionManifest(default="float32").apply(model)
        return _Calibration(model, sites, float32, thresholds, initial_scale, float8).run(
            batches, loss, seed
        )
    finally:
        for layer, policy in saved_policies:
            compat.replace_dtype_policy(layer, policy)


def format_calibration_table(statistics: dict[str, Any]) -> str:
    """The layers of calibration statistics as an aligned text table.

    With float8 rules asked for (`statistics["float8"]`), a second table
    follows after an empty line, one row per Dense or EinsumDense
    (`calibration_float8.FLOAT8_TABLE_COLUMNS`: the amax of inputs, kernel
    and output gradient, and the shares that saturate and underflow). A last
    line tells where the first batch whose gradients were not finite stopped
    being finite, if one was not (`statistics["diagnosis"]`).
    """
    columns = ("path", "class", "act_max", "fp16_err", "bf16_err", "policy", "reason")
    rows = [columns]
    for path, layer in statistics["layers"].items():
        # "-": not measured alone (tied, passing its inputs on, or not called).
        errors = layer["errors"] or {}
        rows.append(
            (
                path,
                layer["class"],
                format_figure(layer["activations"]["max"]),
                format_figure(errors["mixed_float16"]) if errors else "-",
                format_figure(errors["mixed_bfloat16"]) if errors else "-",
                layer["policy"],
                layer["reason"],
            )
        )
    lines = _aligned(rows)
    if statistics.get("float8") and statistics["float8_layers"]:
        lines += [
            "",
            *_aligned([FLOAT8_TABLE_COLUMNS, *float8_table_rows(statistics["float8_layers"])]),
        ]
    if statistics.get("diagnosis"):
        lines.append(statistics["diagnosis"])
    return "\n".join(lines) + "\n"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """`rows` as lines, each column as wide as its widest cell."""
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]


class _FunctionLoss(keras.losses.Loss):
    """A function `loss(y_true, y_pred)` as a Keras loss, which weighs and reduces."""

    def __init__(self, function: Callable[[Any, Any], Any]):
        super().__init__(name=getattr(function, "__name__", "loss"))
        self.function = function

    def call(self, y_true, y_pred):
        return self.function(y_true, y_pred)


def _loss(loss) -> keras.losses.Loss:
    if isinstance(loss, keras.losses.Loss):
        return loss
    if callable(loss):
        return _FunctionLoss(loss)
    raise UserInputError(
        f"loss: received {type(loss).__name__}. "
        "Allowed: a keras.losses.Loss or a function loss(y_true, y_pred)"
    )


def _model(model_or_factory) -> keras.Model:
    if isinstance(model_or_factory, keras.Model):
        return model_or_factory
    if not callable(model_or_factory):
        raise UserInputError(
            f"model_or_factory: received {type(model_or_factory).__name__}. {_MODEL_ALLOWED}"
        )
    model = model_or_factory()
    if not isinstance(model, keras.Model):
        raise UserInputError(
            f"model_or_factory: the factory returned {type(model).__name__}. {_MODEL_ALLOWED}"
        )
    return model


def _batches(data, steps: int, seed: int, batch_size: int) -> Iterator[tuple[Any, Any, Any]]:
    """`(x, y, sample_weight or None)` for each of `steps` batches."""
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
            shape = f"{len(spec)}-tuples" if isinstance(spec, tuple) else type(spec).__name__
            raise UserInputError(f"data: the dataset yields {shape}. {_DATA_ALLOWED}")
        count = 0
        for element in data.take(steps):
            count += 1
            yield (*element, None)[:3]
        if not count:
            raise UserInputError(f"data: the dataset yielded no batch. {_DATA_ALLOWED}")
        return
    if not (isinstance(data, tuple) and len(data) in (2, 3)):
        raise UserInputError(f"data: received {type(data).__name__}. {_DATA_ALLOWED}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserInputError(f"batch_size: must be an integer >= 1, received {batch_size!r}")
    arrays = keras.tree.map_structure(np.asarray, data)
    features, labels, *weights = arrays
    examples = {len(array) for array in keras.tree.flatten(features)}
    if len(examples) != 1:
        raise UserInputError(
            f"data: the arrays of x hold {' and '.join(map(str, sorted(examples)))} examples. "
            "Allowed: as many in each"
        )
    (count,) = examples
    if not count or count != len(labels):
        raise UserInputError(
            f"data: received {count} examples and {len(labels)} labels. "
            "Allowed: as many labels as examples, at least one"
        )
    if weights and len(weights[0]) != count:
        raise UserInputError(
            f"data: received {count} examples and {len(weights[0])} sample weights. "
            "Allowed: one weight per example"
        )
    order = np.random.default_rng(seed).permutation(count)
    # Wrapped around when the arrays hold fewer than steps * batch_size examples.
    indices = np.resize(order, steps * batch_size).reshape(steps, batch_size)
    for batch in indices:
        yield (*keras.tree.map_structure(lambda array: array[batch], arrays), None)[:3]


class _Calibration:
    """The measurements of one `calibrate` call."""

    def __init__(self, model, sites, float32_report, thresholds, initial_scale, float8):
        self._model = model
        self._sites = sites
        self._thresholds = thresholds
        self._scale = initial_scale
        self._float8_rules_asked = float8
        decided_by = {layer.path: layer.decided_by for layer in float32_report.layers}
        self._safe_defaults = [
            (path, Rule("float32", path=re.escape(path), reason=reason))
            for path, reason in decided_by.items()
            if reason.startswith("safe default")
        ]
        self._safe_default = {
            site.path: decided_by[site.path]
            for site in sites.sites
            if decided_by[site.path].startswith("safe default")
        }
        # Each built Dense and EinsumDense, at its first path.
        self._float8_candidates = {
            site.path: site.layer
            for site in sites.sites
            if type(site.layer) in FLOAT8_LAYER_CLASSES and site.layer.built
        }
        self._float8 = Float8Recorder(list(self._float8_candidates.items()))
        self._lead: dict[str, str] = {}  # Per site, the lead of its group.

    def run(self, batches, loss, seed: int) -> CalibrationResult:
        with self._sites.recording():
            for features, _, _ in batches:
                self._model(features, training=False)
        gradients = self._gradient_statistics(batches, loss)
        diagnosis = self._diagnosis(batches, loss, gradients)
        magnitudes = {site.path: _magnitudes(site.outputs()) for site in self._sites.sites}
        layers = {
            site.path: {
                "class": type(site.layer).__name__,
                "activations": _activation_statistics(magnitudes[site.path]),
                "gradients": _layer_gradients(
                    figures for figures in gradients.values() if figures["layer"] == site.path
                ),
                "errors": None,
            }
            for site in self._sites.sites
        }
        default_policy = self._decide_groups(layers, magnitudes, gradients)
        rules = tuple(
            Rule(layer["policy"], path=re.escape(path), reason=layer["reason"])
            for path, layer in layers.items()
            if path not in self._safe_default and layer["policy"] != default_policy
        )
        float8_layers = self._float8_layers(layers, default_policy)
        float8_rules = self._float8_rules(float8_layers)
        statistics = {
            "model": self._model.name,
            "steps": len(batches),
            "seed": seed,
            "initial_scale": self._scale,
            "thresholds": dataclasses.asdict(self._thresholds),
            "default": default_policy,
            "layers": layers,
            "gradients": gradients,
            "diagnosis": diagnosis,
            "float8": self._float8_rules_asked,
            "float8_layers": float8_layers,
        }
        manifest = self._uncaught(PrecisionManifest(default_policy, rules), layers, float8_layers)
        return CalibrationResult(
            statistics, dataclasses.replace(manifest, rules=(*float8_rules, *manifest.rules))
        )

    def _decide_groups(self, layers, magnitudes, gradients) -> str:
        """Decides every group, gives each member its policy and reason in
        `layers`, and returns the default: the policy most measured layers got."""
        groups = self._sites.groups()
        decided, group_figures = {}, {}
        for group in groups:
            lead, paths = group.lead.path, [member.path for member in group.members]
            self._lead.update(dict.fromkeys(paths, lead))
            # A group decides on the figures of all its members.
            group_figures[lead] = {
                "activations": _activation_statistics(
                    np.concatenate([magnitudes[path] for path in paths])
                ),
                "gradients": _layer_gradients(
                    figures for figures in gradients.values() if figures["layer"] in paths
                ),
            }
            if _unmeasured(group) is None:
                references = group.called.outputs()
                layers[lead]["errors"] = group_figures[lead]["errors"] = {
                    policy: self._error(group, policy, references)
                    for policy in LOW_PRECISION_POLICIES
                }
                decided[lead] = self._decide(group, group_figures[lead])
        default = collections.Counter(
            decided[self._lead[path]][0]
            for path in layers
            if path not in self._safe_default and self._lead[path] in decided
        ).most_common(1)
        default_policy = default[0][0] if default else "mixed_float16"
        for group in groups:
            lead = group.lead.path
            if lead not in decided:
                decided[lead] = self._decide_unmeasured(group, group_figures[lead], default_policy)
            policy, reason = decided[lead]
            tied = f"tied to {lead} (they meet in an op of one dtype) -> {policy}"
            for member in group.members:
                layers[member.path]["policy"] = policy
                layers[member.path]["reason"] = reason if member is group.lead else tied
        return default_policy

    def _diagnosis(self, batches, loss, gradients) -> str | None:
        """The diagnosis of the first batch not finite in float32, if one was not.

        Returns:
            `statistics batch <n> of <steps>: first non-finite gradient: <path>`
            (`diagnose_nonfinite`), or None when every gradient was finite.

        Raises:
            UserInputError: If a layer's output was not finite, which no
                precision mends and no decision can be made on.
        """
        outputs_finite = all(
            np.isfinite(output).all() for site in self._sites.sites for output in site.outputs()
        )
        if outputs_finite and all(figures["max"] is not None for figures in gradients.values()):
            return None
        for index, (features, labels, sample_weight) in enumerate(batches):
            report = diagnose_nonfinite(self._model, features, labels, sample_weight, loss=loss)
            batch = f"statistics batch {index + 1} of {len(batches)}"
            if report.first_layer is not None:
                raise UserInputError(
                    f"{batch} is not finite in float32: {report}. "
                    "Allowed: a model and data whose float32 outputs are finite"
                )
            if not report.finite:
                return f"{batch}: {report}"
        return None

    def _uncaught(
        self, manifest: PrecisionManifest, layers, float8_layers: dict[str, dict[str, Any]]
    ) -> PrecisionManifest:
        """`manifest`, with a first rule for each layer a rule meant for another catches.

        As a path below a nested model is one of a layer's path forms, a rule
        for the model's own `dense` also matches `backbone/dense`. The rules
        added name their layer with the model's name in front, a form of its
        path no other layer has. `manifest` has no float8 rules (`apply`
        would turn the model's layers to float8): the layers of those, which
        go first and match them alone, are not checked.
        """
        decided = list(self._safe_defaults) + [
            (path, Rule(layer["policy"], path=re.escape(path), reason=layer["reason"]))
            for path, layer in layers.items()
            if path not in self._safe_default
        ]
        policies = manifest.apply(self._model).policies
        model_name = first_instance_name(self._model)
        caught = tuple(
            dataclasses.replace(rule, path=re.escape(f"{model_name}/{path}"))
            for path, rule in decided
            if policies[path] != rule.policy and float8_layers.get(path, {}).get("policy") != FLOAT8
        )
        return dataclasses.replace(manifest, rules=(*caught, *manifest.rules))

    def _float8_layers(self, layers, default: str) -> dict[str, dict[str, Any]]:
        """Per Dense and EinsumDense path, its float8 figures and decision.

        Its own decision without float8 is in `layers`: a tied layer's is
        its group's.
        """
        limits = self._thresholds
        decided = {}
        for path, figures in self._float8.figures().items():
            policy = layers[path]["policy"]
            if self._lead[path] != path:
                why = f"follows {self._lead[path]}"
            else:
                why = self._safe_default.get(path, "for its numbers")
            recommended, reason = decide_float8(
                figures,
                policy,
                why,
                default,
                limits.max_float8_saturated_fraction,
                limits.max_float8_underflowed_fraction,
            )
            decided[path] = {
                **figures,
                "policy": FLOAT8 if recommended and self._float8_rules_asked else policy,
                "recommended": recommended,
                "reason": reason,
            }
        return decided

    def _float8_rules(self, float8_layers: dict[str, dict[str, Any]]) -> tuple[Rule, ...]:
        """A float8 rule for each layer whose `policy` is float8, matching it alone.

        Checked by matching the path forms of every layer, not by `apply`,
        which would turn the layers to float8 for good: a path another layer
        has too (in a nested model) gets the model's name in front.
        """
        chosen = [path for path, figures in float8_layers.items() if figures["policy"] == FLOAT8]
        entries = list(iter_layer_paths(self._model)) if chosen else []
        model_name = first_instance_name(self._model)
        rules = []
        for path in chosen:
            layer = self._float8_candidates[path]
            rule = Rule(FLOAT8, path=re.escape(path), reason=float8_layers[path]["reason"])
            if any(rule.matches(e.forms, e.layer) for e in entries if e.layer is not layer):
                rule = dataclasses.replace(rule, path=re.escape(f"{model_name}/{path}"))
            rules.append(rule)
        return tuple(rules)

    def _error(self, group: Group, policy: str, references: list[np.ndarray]) -> float | None:
        # The policy the manifest's rules would give the group's members; all
        # other layers are float32 already.
        members = [member.layer for member in group.members]
        for layer in members:
            layer.dtype_policy = policy
        try:
            squared_error = squared_reference = 0.0
            for (args, kwargs, _), reference in zip(group.called.calls, references):
                low = flat_float32(keras.tree.flatten(group.called.layer(*args, **kwargs)))
                squared_error += float(np.sum(np.square(low - reference, dtype=np.float64)))
                squared_reference += float(np.sum(np.square(reference, dtype=np.float64)))
        finally:
            for layer in members:
                layer.dtype_policy = "float32"
        if not math.isfinite(squared_error):
            return None
        return math.sqrt(squared_error / squared_reference) if squared_reference else 0.0

    def _gradient_statistics(self, batches, loss) -> dict[str, dict[str, Any]]:
        """The gradient figures per variable; the float8 recorder records the same pass."""
        owners = {}
        for site in reversed(self._sites.sites):  # A variable's owner is its innermost site.
            for variable in site.layer.trainable_variables:
                owners.setdefault(id(variable), site.path)
        # A float8 layer's scales and amax histories have no gradient: a step
        # overwrites them.
        variables = [v for v in self._model.trainable_variables if not is_float8_state(v)]
        magnitudes = [[] for _ in variables]
        for features, labels, sample_weight in batches:
            with tf.GradientTape() as tape, self._float8.recording(tape):
                predictions = self._model(features, training=False)
                value = loss(labels, predictions, sample_weight=sample_weight)
            gradients, output_gradients = tape.gradient(value, (variables, self._float8.outputs))
            self._float8.add_batch(output_gradients)
            for index, gradient in enumerate(gradients):
                if gradient is not None:
                    magnitudes[index].append(np.abs(tf.convert_to_tensor(gradient).numpy()).ravel())
        statistics = {}
        for variable, pieces in zip(variables, magnitudes):
            values = np.concatenate(pieces).astype(np.float64) if pieces else np.zeros(0)
            scaled = values * self._scale
            nonzero = int(np.count_nonzero(values))
            overflowing = int(np.count_nonzero(scaled > FLOAT16_MAX))
            statistics[variable.path] = {
                "layer": owners.get(id(variable)),
                "max": _number(values.max()) if values.size else 0.0,
                "norm": _number(_norm(values)),
                "flushed_norm_fraction": _flushed_norm_fraction(values, scaled),
                "nonzero_fraction": _fraction(nonzero, values.size),
                "overflow_fraction": _fraction(overflowing, nonzero),
            }
        return statistics

    def _decide(self, group: Group, figures: dict[str, Any]) -> tuple[str, str]:
        """A measured group's policy and reason."""
        safe_default = self._safe_default_of(group)
        if safe_default is not None:
            return "float32", safe_default
        limits = self._thresholds
        problems = self._range_problems(figures)
        # What the measurement covered: a block's own ops, its sublayers apart.
        parts = ["own ops"] if self._sites.holds_sites(group.lead) else []
        tied = [member.path.removeprefix(group.lead.path + "/") for member in group.members[1:]]
        parts += [f"with tied {', '.join(tied)}"] if tied else []
        covered = f"{' '.join(parts)}: " if parts else ""
        float16_error = _or_inf(figures["errors"]["mixed_float16"])
        bfloat16_error = _or_inf(figures["errors"]["mixed_bfloat16"])
        if not problems:
            if float16_error <= limits.max_float16_error:
                return "mixed_float16", (
                    f"{covered}range fits float16, error {float16_error:.2g} <= "
                    f"{limits.max_float16_error:g} -> mixed_float16"
                )
            problems.append(f"float16 error {float16_error:.2g} > {limits.max_float16_error:g}")
        if bfloat16_error <= limits.max_bfloat16_error:
            return "mixed_bfloat16", covered + "; ".join(problems) + " -> mixed_bfloat16"
        return "float32", (
            covered
            + "; ".join(problems)
            + f"; bfloat16 error {bfloat16_error:.2g} > {limits.max_bfloat16_error:g} -> float32"
        )

    def _decide_unmeasured(
        self, group: Group, figures: dict[str, Any], default: str
    ) -> tuple[str, str]:
        """The policy and reason of a layer not measured: the default, unless its range
        rules out a float16 default (see `calibration_sites`)."""
        safe_default = self._safe_default_of(group)
        if safe_default is not None:
            return "float32", safe_default
        why = _unmeasured(group)
        problems = self._range_problems(figures)
        if problems and default == "mixed_float16":
            return "mixed_bfloat16", f"{why}; " + "; ".join(problems) + " -> mixed_bfloat16"
        return default, f"{why} -> the default {default}"

    def _safe_default_of(self, group: Group) -> str | None:
        """The safe default keeping a member float32, which its group follows; or None."""
        for member in group.members:
            if member.path in self._safe_default:
                reason = self._safe_default[member.path]
                return reason if member is group.lead else f"{reason} (tied {member.path})"
        return None

    def _range_problems(self, figures: dict[str, Any]) -> list[str]:
        """What rules float16 out in the activations' range and the flushed norms."""
        limits = self._thresholds
        activations = figures["activations"]
        fits = FLOAT16_MAX / limits.float16_headroom
        flushed_limit = format_share(limits.max_flushed_norm_fraction)
        problems = []
        if activations["max"] > fits:
            problems.append(
                f"activation max {activations['max']:.3g} > {fits:.0f} "
                f"(float16 max 65504 / headroom {limits.float16_headroom:g})"
            )
        # None: not finite in float32, which no precision mends.
        flushed = activations["flushed_norm_fraction"]
        if flushed is not None and flushed > limits.max_flushed_norm_fraction:
            problems.append(
                f"activations: {format_share(flushed)} of their norm flushes to zero in float16 "
                f"(below 6e-08; > {flushed_limit})"
            )
        flushed = figures["gradients"]["flushed_norm_fraction"]
        if flushed is not None and flushed > limits.max_flushed_norm_fraction:
            problems.append(
                f"gradient x {self._scale:g}: {format_share(flushed)} of its norm flushes to "
                f"zero in float16 (below 6e-08; > {flushed_limit})"
            )
        return problems


def _unmeasured(group: Group) -> str | None:
    """Why a group is not measured (it was not called, or passes its inputs on), or None."""
    if not group.called.calls:
        return "not called on the calibration batches"
    passes_through = pass_through_reason(group.lead.layer) if len(group.members) == 1 else None
    return f"no compute worth measuring ({passes_through})" if passes_through else None


def _magnitudes(outputs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.abs(output) for output in outputs] or [np.zeros(0, np.float32)])


def _layer_gradients(variables) -> dict[str, float | None]:
    """`norm` and `flushed_norm_fraction` of the gradients of a layer's variables together."""
    squared_norm = squared_flushed = 0.0
    for figures in variables:
        if figures["norm"] is None or figures["flushed_norm_fraction"] is None:
            return {"norm": None, "flushed_norm_fraction": None}
        squared_norm += figures["norm"] ** 2
        squared_flushed += (figures["norm"] * figures["flushed_norm_fraction"]) ** 2
    fraction = math.sqrt(squared_flushed / squared_norm) if squared_norm else 0.0
    return {"norm": math.sqrt(squared_norm), "flushed_norm_fraction": fraction}


def _flushed_norm_fraction(values: np.ndarray, scaled: np.ndarray) -> float | None:
    """||values whose scaled value float16 flushes to zero|| / ||values||."""
    norm = _norm(values)
    if not math.isfinite(norm):
        return None
    return _norm(values[scaled < FLOAT16_SMALLEST_SUBNORMAL]) / norm if norm else 0.0


def _norm(values: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.square(values, dtype=np.float64))))


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
    figures["flushed_norm_fraction"] = _flushed_norm_fraction(magnitudes, magnitudes)
    return figures


def _fraction(count: int, total: int) -> float:
    return count / total if total else 0.0


def _number(value) -> float | None:
    """A finite float, or None (JSON has no inf or NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def _or_inf(value: float | None) -> float:
    return math.inf if value is None else value

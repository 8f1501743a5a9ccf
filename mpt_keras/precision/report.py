"""The precision report: what every layer of a model computes in, and why.

One report, made three ways:

- `precision_report(model)` describes a built model as it is: each layer's
  policy, compute and variable dtype, and what it really outputs in one
  traced forward pass.
- `PrecisionManifest.apply(model)` adds what decided each layer
  (`decided_by`, `reason`) and the rules that matched nothing
  (`unmatched_rules`) or only layers an earlier rule decided
  (`shadowed_rules`).
- A run (`runs.build_model`, `runs.assemble`) adds its precision (`auto`
  resolved, and why), its manifest file and its `jit_compile` choice, and
  writes `to_dict()` to `precision_report.json` in its `model_dir`;
  `mpt-train --dry_run` prints `format_table()`.

Example:

    with global_policy("mixed_float16"):
        cnn = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
    report = precision_report(cnn)
    report.layers[0].path, report.layers[0].compute_dtype  # ('conv_0', 'float16')
    report.output_dtype_mismatches  # ()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.errors import describe_error
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.policies import effective_policy

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """One layer in a `PrecisionReport`.

    Attributes:
        path: The layer's path from the model down (`layer_paths.iter_layers`:
            the layer names joined by "/"; a softmax or dropout a layer made
            for itself is named by its attribute, `.../attention/_softmax`).
        layer_class: The layer's class name (`"class"` in `to_dict`).
        policy: The policy it computes with (for a layer holding a
            `DTypePolicyMap`, the policy the map gives it).
        compute_dtype: The dtype it computes in.
        variable_dtype: The dtype of its variables.
        output_dtype: The dtype it output in the traced forward pass (see
            `precision_report`); None if it was not called, or returned no
            tensor.
        decided_by: What gave it its policy: `rules[<i>] (<match>)`,
            `safe default: <kind>` or `default`; None in a report of
            `precision_report`, which decides nothing.
        reason: The rule's or safe default's reason, if any.
    """

    path: str
    layer_class: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str | None
    decided_by: str | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the class name as `"class"`."""
        entry = dataclasses.asdict(self)
        return {"path": entry.pop("path"), "class": entry.pop("layer_class"), **entry}


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The precision of every layer of a model, nested ones included, depth first.

    Attributes:
        model: The model's name.
        layers: Every layer, depth first.
        trainable_variables: How many trainable variables have each dtype
            (the master weights: all float32 under a `mixed_*` policy).
        output_dtype_mismatches: The paths of the layers that made a floating
            output of another dtype than they compute in (see
            `precision_report`).
        unmatched_rules: A manifest's rules that matched no layer, as
            `rules[<i>] (<match>)`.
        shadowed_rules: A manifest's rules that matched layers, but only
            layers an earlier rule decided.
        precision: A run's policy (`auto` resolved; a manifest's default);
            None outside a run.
        precision_reason: Why `auto` chose `precision`; None otherwise.
        manifest: The path of a run's manifest file, if any.
        jit_compile: Whether XLA compiles the run's train step; None until
            the run is compiled.
        jit_compile_reason: Why, in one line.

    Example:

        cnn = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
        report = PrecisionManifest.from_json("configs/manifests/digits_cnn.json").apply(cnn)
        report.policies["dense"], report.policies["logits"]  # ('mixed_bfloat16', 'float32')
        report.layers[0].decided_by  # "rules[0] (path 'conv_0')"
        report.unmatched_rules  # ()
    """

    model: str
    layers: tuple[LayerPrecision, ...]
    trainable_variables: Mapping[str, int]
    output_dtype_mismatches: tuple[str, ...]
    unmatched_rules: tuple[str, ...] = ()
    shadowed_rules: tuple[str, ...] = ()
    precision: str | None = None
    precision_reason: str | None = None
    manifest: str | None = None
    jit_compile: bool | None = None
    jit_compile_reason: str | None = None

    @property
    def policies(self) -> dict[str, str]:
        """`{layer path: policy name}`."""
        return {layer.path: layer.policy for layer in self.layers}

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: what `precision_report.json` holds, every key always present."""
        return {
            "precision": self.precision,
            "precision_reason": self.precision_reason,
            "manifest": self.manifest,
            "model": self.model,
            "layers": [layer.to_dict() for layer in self.layers],
            "trainable_variables": dict(self.trainable_variables),
            "output_dtype_mismatches": list(self.output_dtype_mismatches),
            "unmatched_rules": list(self.unmatched_rules),
            "shadowed_rules": list(self.shadowed_rules),
            "jit_compile": self.jit_compile,
            "jit_compile_reason": self.jit_compile_reason,
        }

    def format_table(self) -> str:
        """The layers as an aligned text table: path, class, policy, decided_by.

        A layer in `output_dtype_mismatches` is marked at the end of its row:
        `<- outputs float32, computes in bfloat16`.
        """
        rows = [("path", "class", "policy", "decided_by")] + [
            (layer.path, layer.layer_class, layer.policy, layer.decided_by or "")
            for layer in self.layers
        ]
        widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
        marks = [""] + [
            f"<- outputs {layer.output_dtype}, computes in {layer.compute_dtype}"
            if layer.path in self.output_dtype_mismatches
            else ""
            for layer in self.layers
        ]
        lines = [
            "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), mark]).rstrip()
            for row, mark in zip(rows, marks)
        ]
        return "\n".join(lines) + "\n"


def precision_report(
    model: keras.Model, inputs: Any = None, *, trace: bool = True
) -> PrecisionReport:
    """Describes the precision of every layer of `model`, nested ones included.

    Each layer's output dtype is what it returned in one forward pass of the
    model traced as the train step calls it (`training=True`, in a
    `tf.function` that never runs: no data, no state changes); each layer's
    `call` is wrapped for the trace and restored after it, even on error. A
    model not built yet, or one the trace fails on (logged as a warning), has
    output dtypes None.

    A layer's output is a mismatch (`output_dtype_mismatches`) when it made a
    floating output of another dtype than its compute dtype (a float32 NumPy
    constant mixed into a bfloat16 input makes float32); its `output_dtype`
    is that one. Integer outputs, and a tensor a layer returns as it was given
    it or as a sublayer returned it (an attention returning its output
    projection's bfloat16 under a float16 policy), are not the layer's
    mismatch: the sublayer is flagged if it made it.

    Args:
        model: A model, built to be traced.
        inputs: What the model is traced on: example inputs (arrays or
            tensors; one example is enough) or their specs (`keras.Input`,
            `tf.TensorSpec`), structured as the model takes them. Default: a
            functional or Sequential model's own inputs; a subclassed model
            has none, so without `inputs` its layers' output dtypes are None.
        trace: False leaves every output dtype None and traces nothing: for
            a caller that reads the policies only (a trace of a large model
            takes seconds).

    Returns:
        The report, without decisions (`decided_by` None) or run settings.
    """
    returned = _returned_dtypes(model, inputs) if trace else {}
    layers, mismatches = [], []
    for path, layer in iter_layers(model):
        output_dtype, mismatched = _output_dtype(returned.get(id(layer), ()), layer.compute_dtype)
        layers.append(
            LayerPrecision(
                path=path,
                layer_class=type(layer).__name__,
                policy=effective_policy(layer).name,
                compute_dtype=layer.compute_dtype,
                variable_dtype=layer.variable_dtype,
                output_dtype=output_dtype,
            )
        )
        if mismatched:
            mismatches.append(path)
    variable_dtypes: dict[str, int] = {}
    for variable in model.trainable_variables:
        variable_dtypes[variable.dtype] = variable_dtypes.get(variable.dtype, 0) + 1
    return PrecisionReport(
        model=model.name,
        layers=tuple(layers),
        trainable_variables=variable_dtypes,
        output_dtype_mismatches=tuple(mismatches),
    )


def _output_dtype(
    returned: Sequence[tuple[str, bool]], compute_dtype: str
) -> tuple[str | None, bool]:
    """A layer's output dtype, and whether it made a floating one other than `compute_dtype`.

    Args:
        returned: `(dtype, made by the layer)` of each tensor it returned, in
            every call.
        compute_dtype: The layer's compute dtype.
    """
    if keras.backend.is_float_dtype(compute_dtype):
        for dtype, made in returned:
            if made and keras.backend.is_float_dtype(dtype) and dtype != compute_dtype:
                return dtype, True
    floating = [dtype for dtype, _ in returned if keras.backend.is_float_dtype(dtype)]
    dtypes = floating or [dtype for dtype, _ in returned]
    return (dtypes[0] if dtypes else None), False


def _returned_dtypes(model: keras.Model, inputs: Any) -> dict[int, list[tuple[str, bool]]]:
    """`{id(layer): [(dtype, made by the layer), ...]}` of every tensor each
    layer of `model` returned in one traced forward pass; empty if the model
    is not built or has no inputs to trace it on, or if the trace fails."""
    if inputs is None:
        inputs = _symbolic_inputs(model)
    if not model.built or inputs is None:
        return {}
    specs = keras.tree.map_structure(
        lambda value: tf.TensorSpec(
            tuple(value.shape), keras.backend.standardize_dtype(value.dtype)
        ),
        inputs,
    )
    layers = list({id(layer): layer for _, layer in iter_layers(model)}.values())
    recorder = _CallRecorder()

    @tf.function
    def train_forward(values):
        return model(values, training=True)

    try:
        with (
            recorder.wrapping(layers),
            compat.call_records_restored([model, *layers]),
            keras.StatelessScope(),  # Nothing the trace assigns or adds as a loss is kept.
        ):
            train_forward.get_concrete_function(specs)
    except Exception as error:  # The report still describes the policies.
        # Keras and AutoGraph wrap the error of the layer that failed.
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__
        _LOGGER.warning(
            "Model %s: not traced to find each layer's output dtype (%s)",
            model.name,
            describe_error(error),
        )
        return {}
    return recorder.returned


def _symbolic_inputs(model: keras.Model) -> Any:
    """A functional or Sequential model's inputs, as it takes them; else None."""
    if isinstance(model, keras.Sequential):
        return model.inputs[0] if model.built else None
    return model.input if hasattr(model, "inputs") else None


class _CallRecorder:
    """Wraps the `call` of layers and records the dtypes of the tensors they return.

    A returned tensor is the layer's own (`made`) unless the call was given
    it, or a layer called inside the call returned it.
    """

    def __init__(self):
        self.returned: dict[int, list[tuple[str, bool]]] = {}
        # Per call under way, the tensors it was given or its sublayers
        # returned, by id (held, so that no id is reused during the trace).
        self._not_made: list[dict[int, Any]] = []

    def wrapping(self, layers: Iterable[keras.layers.Layer]) -> contextlib.AbstractContextManager:
        """Wraps each layer's `call` inside the block; restores them on exit, even on error."""
        return calls_wrapped(layers, self._recording)

    def _recording(self, layer: keras.layers.Layer, call: Any) -> Any:
        @functools.wraps(call)
        def recording_call(*args, **kwargs):
            self._not_made.append({id(tensor): tensor for tensor in _tensors((args, kwargs))})
            try:
                outputs = call(*args, **kwargs)
            finally:
                not_made = self._not_made.pop()
            tensors = _tensors(outputs)
            self.returned.setdefault(id(layer), []).extend(
                (keras.backend.standardize_dtype(tensor.dtype), id(tensor) not in not_made)
                for tensor in tensors
            )
            for enclosing in self._not_made:
                enclosing.update((id(tensor), tensor) for tensor in tensors)
            return outputs

        return recording_call


def _tensors(structure: Any) -> list[Any]:
    return [value for value in keras.tree.flatten(structure) if keras.ops.is_tensor(value)]

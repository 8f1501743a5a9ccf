"""The precision report: what every layer of a model computes in, and why.

`precision_report(model)` describes a model as it is; `PrecisionManifest.apply` adds the
decisions and unmatched and shadowed rules; a run adds its settings, writes `to_dict()` to
`precision_report.json` and prints `format_table()` for `--dry_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.errors import describe_error
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.float8_census import Float8Census
from mpt_keras.precision.hand_back import handed_back_dtype
from mpt_keras.precision.policies import effective_policy
from mpt_keras.tables import aligned

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """One layer in a `PrecisionReport`: the `policy` it computes with (through a
    `DTypePolicyMap`), its `output_dtype` in the traced pass (None if not called or no
    tensor), and `decided_by`: `rules[<i>] (<match>)`, `safe default: <kind>` or `default`.
    `returns_dtype`: the dtype it hands its outputs back in to the block calling it, which
    computes in that one (`hand_back`); None: its outputs as it makes them."""

    path: str
    layer_class: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str | None
    decided_by: str | None = None
    reason: str | None = None
    returns_dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the class name as `"class"`."""
        entry = dataclasses.asdict(self)
        return {"path": entry.pop("path"), "class": entry.pop("layer_class"), **entry}


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The precision of every layer of a model, nested ones included, depth first.

    `output_dtype_mismatches`: see `precision_report`. `unmatched_rules`: a manifest's rules
    that matched no layer; `shadowed_rules`: those matching only layers an earlier rule
    decided. `precision` (`auto` resolved; a manifest's default), `manifest`, `jit_compile`
    and the reasons are a run's: None outside one, `jit_compile` until it is compiled.
    `float8_census`: `plan_precision`'s, where float8 layers are (else None).
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
    float8_census: Float8Census | None = None

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
            "float8_census": self.float8_census.to_dict() if self.float8_census else None,
        }

    def format_table(self) -> str:
        """The layers as an aligned table (path, class, policy, decided_by), mismatches and
        the dtype a layer hands back to its block marked."""
        rows = [("path", "class", "policy", "decided_by", "")] + [
            (
                layer.path,
                layer.layer_class,
                layer.policy,
                layer.decided_by or "",
                _note(layer, layer.path in self.output_dtype_mismatches),
            )
            for layer in self.layers
        ]
        table = "\n".join(aligned(rows)) + "\n"
        return table + ("\n" + self.float8_census.format_table() if self.float8_census else "")


def _note(layer: LayerPrecision, mismatched: bool) -> str:
    """The table's last column: a mismatch, or the dtype handed back to the block."""
    if mismatched:
        return f"<- outputs {layer.output_dtype}, computes in {layer.compute_dtype}"
    if layer.returns_dtype:
        return f"<- returns {layer.returns_dtype} to its block"
    return ""


def precision_report(
    model: keras.Model, inputs: Any = None, *, trace: bool = True
) -> PrecisionReport:
    """Describes the precision of every layer of `model`, nested ones included.

    Output dtypes come from one forward pass traced as the train step calls it
    (`training=True`, in a `tf.function` or `jax.eval_shape` never run: no data, no state
    change); None if the model is not built or the trace fails (logged). A mismatch is a
    floating tensor the layer itself made in another dtype than it computes in (a float32
    NumPy constant mixed into bfloat16), not one it was given or a sublayer returned, nor
    the dtype a layer hands back to its block (`returns_dtype`).

    `inputs`: example inputs or specs (`keras.Input`, `tf.TensorSpec`) as the model takes
    them; default a functional or Sequential model's own (a subclassed model has none).
    `trace=False` traces nothing (a large model's trace takes seconds).
    """
    returned = _returned_dtypes(model, inputs) if trace else {}
    layers, mismatches = [], []
    for path, layer in iter_layers(model):
        returns_dtype = handed_back_dtype(layer)
        output_dtype, mismatched = _output_dtype(
            returned.get(id(layer), ()), returns_dtype or layer.compute_dtype
        )
        layers.append(
            LayerPrecision(
                path=path,
                layer_class=type(layer).__name__,
                policy=effective_policy(layer).name,
                compute_dtype=layer.compute_dtype,
                variable_dtype=layer.variable_dtype,
                output_dtype=output_dtype,
                returns_dtype=returns_dtype,
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


def _output_dtype(returned: Sequence[tuple[str, bool]], expected: str) -> tuple[str | None, bool]:
    """A layer's output dtype, and whether it made a floating one other than `expected`,
    from `(dtype, made by the layer)` per tensor it returned."""
    if keras.backend.is_float_dtype(expected):
        for dtype, made in returned:
            if made and keras.backend.is_float_dtype(dtype) and dtype != expected:
                return dtype, True
    floating = [dtype for dtype, _ in returned if keras.backend.is_float_dtype(dtype)]
    dtypes = floating or [dtype for dtype, _ in returned]
    return (dtypes[0] if dtypes else None), False


def _returned_dtypes(model: keras.Model, inputs: Any) -> dict[int, list[tuple[str, bool]]]:
    """`{id(layer): [(dtype, made by the layer), ...]}` from one traced forward pass; empty
    if there is nothing to trace or the trace fails."""
    if inputs is None:
        inputs = _symbolic_inputs(model)
    if not model.built or inputs is None:
        return {}
    layers = list({id(layer): layer for _, layer in iter_layers(model)}.values())
    recorder = _CallRecorder()
    try:
        with (
            recorder.wrapping(layers),
            compat.call_records_restored([model, *layers]),
            keras.StatelessScope(),  # Nothing the trace assigns or adds as a loss is kept.
        ):
            _trace_forward(model, inputs)
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


def _trace_forward(model: keras.Model, inputs: Any) -> None:
    """Traces `model(inputs, training=True)` without running it: a `tf.function`'s concrete
    function on TensorFlow, `jax.eval_shape` on JAX (a batch of 1 where the size is open)."""

    def train_forward(values: Any) -> Any:
        return model(values, training=True)

    if current.is_jax():
        from mpt_keras.backend.jax.devices import trace_without_running
    else:
        from mpt_keras.backend.tensorflow.devices import trace_without_running
    trace_without_running(train_forward, inputs)


def _symbolic_inputs(model: keras.Model) -> Any:
    """A functional or Sequential model's inputs, as it takes them; else None."""
    if isinstance(model, keras.Sequential):
        return model.inputs[0] if model.built else None
    return model.input if hasattr(model, "inputs") else None


class _CallRecorder:
    """Records the dtypes layers' calls return; a tensor given to the call or returned by a
    sublayer is not the layer's own (`made`)."""

    def __init__(self):
        self.returned: dict[int, list[tuple[str, bool]]] = {}
        # Per call under way, the tensors not its own, by id (held: no id reused).
        self._not_made: list[dict[int, Any]] = []

    @contextlib.contextmanager
    def wrapping(self, layers: Iterable[keras.layers.Layer]) -> Iterator[None]:
        """Records every layer's calls (a quantized layer's too: `calls_wrapped`)."""
        with calls_wrapped(layers, self._recording):
            yield

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

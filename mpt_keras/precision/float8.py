"""Float8 training of chosen Dense and EinsumDense layers, on Keras' own mechanism.

Keras 3 trains `Dense` and `EinsumDense` in float8 once `layer.quantize("float8")`
has run: the layer quantizes three tensors, each by a per-tensor scale taken
from a history of its amax (largest magnitude), "delayed scaling" as NVIDIA's
Transformer Engine does it:

    tensor         format   Keras' variables (float32, on the layer)
    inputs         e4m3     inputs_scale, inputs_amax_history
    kernel         e4m3     kernel_scale, kernel_amax_history
    outputs_grad   e5m2     outputs_grad_scale, outputs_grad_amax_history

A tensor (the output gradient in the backward pass) is divided by its scale,
clipped to the format's largest value (448 in e4m3, 57344 in e5m2), cast to
float8 and back, and multiplied by the scale again. In training, the layer's
backward pass returns each tensor's new scale (its history's largest amax over
the format's largest value, the old scale while the history holds no finite
nonzero amax) and new history (rolled by one, the step's amax in slot 0) as
the "gradients" of these variables, which Keras marks
`overwrite_with_gradient`: the optimizer writes them as they are
(`mpt_keras.LossScaleOptimizer` never unscales them, and a skipped step writes
nothing). The history holds 1024 steps. A step quantizes with the scale of the
amaxes up to two steps before it.

Under a float16 loss scale the output gradient is the scaled one, and its
history follows the loss scale: after a growth the next two steps quantize
the doubled gradient at the scale of before (its largest values saturate),
and after a backoff the history's largest amax stays twice too large for up
to 1024 steps (a binade more of small gradients underflows). bfloat16, which
needs no loss scale, has neither.

The layer keeps the compute dtype of the policy it had: `quantize` gives it
Keras' policy `float8_from_<that policy>` (`float8_from_mixed_bfloat16`
computes in bfloat16 outside the float8 matmul). So the order is: give the
layer its mixed policy, build the model, call `to_float8`, then build the
optimizer (the first step or `optimizer.build`). Setting a plain policy on the
layer afterwards turns float8 off and leaves its state unused.

Keras' float8 layers train only in a compiled function (`tf.function`, Keras'
train step, XLA): in eager mode Keras 3.15.1's custom gradient fails on the
TensorFlow backend ("too many values to unpack"), with or without this
package.

Example:

    model = build_transformer_lm(vocab_size=64, sequence_length=16)  # Functional: built.
    to_float8(model, ["block_0/mlp_up", "block_0/attention/query"])  # Both turned.
    float8_statistics(model)["block_0/mlp_up"].inputs.scale  # 1.0 before training
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layer_paths

# Keras' own classes only: Keras refuses to quantize a subclass, whose call it
# cannot know (`quantize(type_check=True)`).
FLOAT8_LAYER_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)
_CLASS_NAMES = ", ".join(cls.__name__ for cls in FLOAT8_LAYER_CLASSES)
# The float8 formats by their short names, with Keras' dtype names.
FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# The tensors a float8 layer quantizes, each with its format; its variables
# are `<tensor>_scale` and `<tensor>_amax_history`.
QUANTIZED_TENSORS = {"inputs": "e4m3", "kernel": "e4m3", "outputs_grad": "e5m2"}
FLOAT8_VARIABLE_NAMES = tuple(
    f"{tensor}_{kind}" for tensor in QUANTIZED_TENSORS for kind in ("scale", "amax_history")
)


@dataclasses.dataclass(frozen=True)
class Float8Shares:
    """The shares of a tensor's values that float8 loses at a scale.

    Each is a float eagerly, a float32 tensor in a graph.

    Attributes:
        saturated: Values whose magnitude over the scale is above the format's
            largest (Inf too): Keras clips them to it.
        underflowed: Nonzero values that become zero in the format.
    """

    saturated: float | tf.Tensor
    underflowed: float | tf.Tensor


@dataclasses.dataclass(frozen=True)
class Float8TensorState:
    """One quantized tensor of a float8 layer, as its variables hold it.

    Attributes:
        format: `e4m3` or `e5m2`.
        scale: The scale the next step quantizes with (the tensor is divided
            by it, then cast).
        amax: The tensor's largest magnitude at the last training step
            (slot 0 of the history; 0.0 before the first).
    """

    format: str
    scale: float
    amax: float

    @property
    def range_used(self) -> float:
        """`amax` over the largest value the scale represents: above 1, a tensor
        like the last one saturates at this scale (Inf at a scale of 0)."""
        largest = format_max(self.format) * self.scale
        return self.amax / largest if largest else math.inf


@dataclasses.dataclass(frozen=True)
class Float8LayerStatistics:
    """A float8 layer's state: its three quantized tensors, and its kernel's losses.

    Attributes:
        inputs: The inputs' state (e4m3).
        kernel: The kernel's state (e4m3).
        outputs_grad: The output gradient's state (e5m2). Its amax is of the
            gradient of the loss as scaled by a loss-scale optimizer.
        kernel_shares: The kernel's values lost at its current scale.
    """

    inputs: Float8TensorState
    kernel: Float8TensorState
    outputs_grad: Float8TensorState
    kernel_shares: Float8Shares

    def scalars(self) -> dict[str, float]:
        """The statistics as flat `{name: value}` (`inputs/scale`, ..., `kernel/saturated`)."""
        scalars = {}
        for tensor in QUANTIZED_TENSORS:
            state = getattr(self, tensor)
            scalars[f"{tensor}/scale"] = state.scale
            scalars[f"{tensor}/amax"] = state.amax
            scalars[f"{tensor}/range_used"] = state.range_used
        scalars["kernel/saturated"] = self.kernel_shares.saturated
        scalars["kernel/underflowed"] = self.kernel_shares.underflowed
        return scalars


def is_float8(layer: Any) -> bool:
    """Whether `layer` trains in float8 (Keras' quantization mode `float8`)."""
    return getattr(layer, "quantization_mode", None) == "float8"


def is_float8_state(variable: Any) -> bool:
    """Whether `variable` is a float8 layer's scale or amax history.

    Keras marks them `overwrite_with_gradient`: a step writes the new value
    the layer computed, not a gradient update.
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


def learned_weights(model: keras.Model) -> list[keras.Variable]:
    """`model.weights` without its float8 state, in order.

    The weights a model in float8 shares with the same model without it. A
    layer `to_float8` turned holds its float8 state after its kernel and bias,
    so `other.get_weights()` copies into these in order; a float8 model loaded
    from a file lists that state first, but its other weights keep their order.
    """
    return [variable for variable in model.weights if not is_float8_state(variable)]


def check_float8_layer(path: str, layer: Any) -> None:
    """Raises if `layer` cannot train in float8.

    Args:
        path: The layer's path, for the message.
        layer: The layer.

    Raises:
        UserInputError: Naming the path and the class, unless the layer is a
            `Dense` or `EinsumDense` (not a subclass).
    """
    if type(layer) not in FLOAT8_LAYER_CLASSES:
        raise UserInputError(
            f"layer '{path}': {type(layer).__name__} cannot train in float8. "
            f"Allowed: {_CLASS_NAMES} (Keras' own, not subclasses)"
        )


def to_float8(model: keras.Model, paths: Iterable[str]) -> tuple[str, ...]:
    """Turns the layers of `model` at `paths` to float8, each keeping its compute dtype.

    Runs Keras' `layer.quantize("float8")` on each (see the module docstring)
    and has Keras trace the model's train, test and predict functions again.
    Call it under the strategy scope the model was built in, after the layers
    have their dtype policies and the model is built, before the optimizer is
    built.

    Args:
        model: A built model.
        paths: Layer paths (`mpt_keras.keras_bridge.layer_paths`); a layer already in
            float8 is left as it is.

    Returns:
        The paths of the layers turned, in the order given.

    Raises:
        UserInputError: A path names no layer of the model, or a layer that
            is not a `Dense` or `EinsumDense`.
        ValueError: A layer is not built, or the model's optimizer is: it
            would not know the new variables.
    """
    layers = {entry.path: entry.layer for entry in iter_layer_paths(model)}
    paths = list(dict.fromkeys(paths))
    for path in paths:
        if path not in layers:
            allowed = [p for p, layer in layers.items() if type(layer) in FLOAT8_LAYER_CLASSES]
            raise UserInputError(
                f"layer '{path}': model '{model.name}' has no layer at this path. "
                f"Allowed: the paths of its {_CLASS_NAMES} layers: {', '.join(allowed) or 'none'}"
            )
        check_float8_layer(path, layers[path])
    chosen, seen = [], set()
    for path in paths:  # A layer found at several paths (shared) is turned once.
        if id(layers[path]) not in seen and not is_float8(layers[path]):
            seen.add(id(layers[path]))
            chosen.append(path)
    for path in chosen:
        if not layers[path].built:
            raise ValueError(f"layer '{path}' is not built: build the model before to_float8")
    optimizer = getattr(model, "optimizer", None)
    if chosen and optimizer is not None and optimizer.built:
        raise ValueError(
            f"model '{model.name}': its optimizer is built, and would not know the float8 "
            "variables: call to_float8 before the first step"
        )
    for path in chosen:
        layers[path].quantize("float8")
    if chosen:
        model.train_function = model.test_function = model.predict_function = None
    return tuple(chosen)


def float8_variables(model: keras.Model) -> dict[str, dict[str, keras.Variable]]:
    """The float8 state of every float8 layer of `model`.

    Returns:
        `{layer path: {name: variable}}`, the names `FLOAT8_VARIABLE_NAMES`
        (`inputs_scale`, `inputs_amax_history`, ...), Keras' own.
    """
    return {
        path: {name: getattr(layer, name) for name in FLOAT8_VARIABLE_NAMES}
        for path, layer in _float8_layers(model)
    }


def float8_statistics(model: keras.Model) -> dict[str, Float8LayerStatistics]:
    """The statistics of every float8 layer of `model`, by layer path.

    Call eagerly: reading the variables syncs with the device.
    """
    statistics = {}
    for path, layer in _float8_layers(model):
        states = {
            tensor: Float8TensorState(
                format=float8_format,
                scale=float(getattr(layer, f"{tensor}_scale").numpy()),
                amax=float(getattr(layer, f"{tensor}_amax_history").numpy()[0]),
            )
            for tensor, float8_format in QUANTIZED_TENSORS.items()
        }
        kernel_shares = float8_shares(layer.kernel, "e4m3", states["kernel"].scale)
        statistics[path] = Float8LayerStatistics(**states, kernel_shares=kernel_shares)
    return statistics


def largest_range_used(variables: Iterable[keras.Variable]) -> tf.Tensor | None:
    """The largest `range_used` of the float8 tensors whose state is in `variables`.

    What `LossScaleOptimizer.step_logs` logs as `float8_range_used`: over every
    float8 layer and quantized tensor, its last amax (slot 0 of the history)
    over the largest value its scale represents (`Float8TensorState.range_used`).
    Above 1, a tensor like the last one saturates at the scale the next step
    uses. Reads the variables in the graph it is called in: no host sync.

    Args:
        variables: Variables of a model (a layer's float8 state is paired by
            path: `<layer>/<tensor>_scale` with `<layer>/<tensor>_amax_history`);
            the others are left out.

    Returns:
        A float32 scalar, or None when `variables` hold no float8 state.
    """
    state = {variable.path: variable for variable in variables if is_float8_state(variable)}
    ratios = []
    for path, scale in state.items():
        layer, _, name = path.rpartition("/")
        tensor = name.removesuffix("_scale")
        if tensor != name and tensor in QUANTIZED_TENSORS:
            history = state[f"{layer}/{tensor}_amax_history"]
            largest = format_max(QUANTIZED_TENSORS[tensor]) * ops.cast(scale, "float32")
            ratios.append(ops.cast(history[0], "float32") / largest)
    return ops.max(ops.stack(ratios)) if ratios else None


def float8_shares(values: Any, float8_format: str, scale: Any = 1.0) -> Float8Shares:
    """The shares of `values` that saturate or underflow in `float8_format` at `scale`.

    Quantizes as Keras' float8 layers do (`values / scale`, clipped to the
    format's largest value, cast), in float32. A pure function of its
    arguments.

    Args:
        values: A tensor or array (any shape, any floating dtype).
        float8_format: `e4m3` (inputs, kernels) or `e5m2` (gradients).
        scale: The scale (a float or scalar tensor; a layer's `*_scale`).

    Returns:
        The shares, of all the values: floats eagerly, tensors in a graph.

    Raises:
        UserInputError: For a format other than `e4m3` and `e5m2`.

    Example:

        float8_shares([0.0, 1.0, 500.0, 2.0**-11], "e4m3")  # saturated 0.25, underflowed 0.25
    """
    largest = format_max(float8_format)
    values = ops.cast(ops.convert_to_tensor(values), "float32")
    scaled = values / ops.cast(scale, "float32")
    quantized = ops.cast(ops.clip(scaled, -largest, largest), FORMATS[float8_format])
    count = ops.cast(ops.maximum(ops.size(values), 1), "float32")
    saturated = ops.sum(ops.cast(ops.abs(scaled) > largest, "float32")) / count
    flushed = (values != 0) & (ops.cast(quantized, "float32") == 0)
    underflowed = ops.sum(ops.cast(flushed, "float32")) / count
    if tf.executing_eagerly():
        return Float8Shares(saturated=float(saturated), underflowed=float(underflowed))
    return Float8Shares(saturated=saturated, underflowed=underflowed)


def format_max(float8_format: str) -> float:
    """The largest finite value of `float8_format` (`e4m3`: 448, `e5m2`: 57344).

    Raises:
        UserInputError: For a format other than `e4m3` and `e5m2`.
    """
    if float8_format not in FORMATS:
        raise UserInputError(
            f"float8 format '{float8_format}': unknown. Allowed: {', '.join(FORMATS)}"
        )
    return float(tf.as_dtype(FORMATS[float8_format]).max)


def _float8_layers(model: keras.Model) -> list[tuple[str, Any]]:
    return [
        (entry.path, entry.layer) for entry in iter_layer_paths(model) if is_float8(entry.layer)
    ]

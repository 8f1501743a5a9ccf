"""Float8 training of chosen Dense and EinsumDense layers, on Keras' own variables.

`layer.quantize("float8")` gives a layer Keras' float8 state: `inputs`, `kernel` (e4m3) and
`outputs_grad` (e5m2) scaled per tensor, by default from a 1024-step amax history ("delayed
scaling"); `to_float8` then runs its GEMMs as `float8_gemms` writes them (delayed or current
scaling). The backward pass returns the new state as `overwrite_with_gradient`
"gradients", written as they are (never unscaled; a skipped step writes nothing). Under a
float16 loss scale the gradient's history follows the scale: a growth saturates two steps,
a backoff underflows a binade more for up to 1024 steps.

Order: the mixed policy, build, `to_float8`, then build the optimizer. Float8 layers train
only compiled (eagerly, Keras 3.15.1's custom gradient fails on TensorFlow).

Example:

    to_float8(model, ["block_0/mlp_up", "block_0/attention/query"])  # A built model.
    float8_statistics(model)["block_0/mlp_up"].inputs.scale  # 1.0 before training
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import ml_dtypes
from keras import ops

from mpt_keras.backend import current
from mpt_keras.checks import check_choice
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.keras_bridge.traced_functions import forget_traced_functions
from mpt_keras.precision.float8_gemms import (
    DEFAULT_RECIPE,
    check_installable,
    install_float8_gemms,
)

# Keras' own classes only: Keras refuses to quantize a subclass (`type_check=True`).
FLOAT8_LAYER_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)
_CLASS_NAMES = ", ".join(cls.__name__ for cls in FLOAT8_LAYER_CLASSES)
FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# Each quantized tensor's format; its variables are `<tensor>_scale`, `<tensor>_amax_history`.
QUANTIZED_TENSORS = {"inputs": "e4m3", "kernel": "e4m3", "outputs_grad": "e5m2"}
FLOAT8_VARIABLE_NAMES = tuple(
    f"{tensor}_{kind}" for tensor in QUANTIZED_TENSORS for kind in ("scale", "amax_history")
)


@dataclasses.dataclass(frozen=True)
class Float8Shares:
    """Shares of a tensor's values float8 loses at a scale (floats, or graph tensors):
    `saturated` (clipped to the format's largest; Inf too), `underflowed` (nonzero to zero)."""

    saturated: Any  # A float eagerly, a tensor in a trace.
    underflowed: Any


@dataclasses.dataclass(frozen=True)
class Float8TensorState:
    """One quantized tensor of a float8 layer: its `format`, the `scale` the next step divides
    it by, and `amax`, its largest magnitude at the last step (0.0 before any)."""

    format: str
    scale: float
    amax: float

    @property
    def range_used(self) -> float:
        """`amax` over the largest value the scale represents: above 1, a tensor like the
        last one saturates (Inf at a scale of 0)."""
        largest = format_max(self.format) * self.scale
        return self.amax / largest if largest else math.inf


@dataclasses.dataclass(frozen=True)
class Float8LayerStatistics:
    """A float8 layer's quantized tensors and its kernel's losses; `outputs_grad.amax` is of
    the loss-scaled gradient."""

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
    """Whether `variable` is a float8 layer's scale or amax history (`overwrite_with_gradient`)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def learned_weights(model: keras.Model) -> list[keras.Variable]:
    """`model.weights` less its float8 state, in order: what `get_weights()` of the model
    without float8 copies into (a loaded float8 model lists that state first)."""
    return [variable for variable in model.weights if not is_float8_state(variable)]


def check_float8_layer(path: str, layer: Any) -> None:
    """Raises `UserInputError` naming `path` unless `layer` is a `Dense` or `EinsumDense`."""
    if type(layer) not in FLOAT8_LAYER_CLASSES:
        raise UserInputError(
            f"layer '{path}': {type(layer).__name__} cannot train in float8. "
            f"Allowed: {_CLASS_NAMES} (Keras' own, not subclasses)"
        )


def check_optimizer_unbuilt(model: keras.Model, paths: Sequence[str]) -> None:
    """Raises `UserInputError` if `paths` name layers to turn float8 and `model`'s optimizer
    is built: it would never update or save their new variables (the float8 state)."""
    optimizer = getattr(model, "optimizer", None)
    if paths and optimizer is not None and optimizer.built:
        raise UserInputError(
            f"model '{model.name}': its optimizer is built (it has trained, or was loaded with "
            f"its state), and would not know the float8 variables of the layers turning float8 "
            f"({len(paths)}, '{paths[0]}' first). Allowed: float8 layers before the first "
            "train step, or after compiling with a new optimizer"
        )


def to_float8(
    model: keras.Model, paths: Iterable[str], recipe: str = DEFAULT_RECIPE
) -> tuple[str, ...]:
    """Turns the layers at `paths` to float8 (`layer.quantize`), keeping compute dtypes, their
    GEMMs written for XLA's float8 rewrite, scaled by `recipe` (`float8_gemms`).

    Call under the strategy scope, with policies set and the model built, before its
    optimizer is built. Returns the paths turned, in order (layers already float8 are left,
    and given `recipe`).
    Raises `UserInputError` for a path naming no `Dense`/`EinsumDense` or where the optimizer
    is built (`check_optimizer_unbuilt`), `ValueError` if a layer is not built.
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
        check_installable(layers[path], path, recipe)
    chosen, seen = [], set()
    for path in paths:  # A layer found at several paths (shared) is turned once.
        if id(layers[path]) not in seen and not is_float8(layers[path]):
            seen.add(id(layers[path]))
            chosen.append(path)
    for path in chosen:
        if not layers[path].built:
            raise ValueError(f"layer '{path}' is not built: build the model before to_float8")
    check_optimizer_unbuilt(model, chosen)
    for path in chosen:
        layers[path].quantize("float8")
    for path in paths:
        install_float8_gemms(layers[path], path, recipe)
    forget_traced_functions(model)  # Those traced before would run the layers' old call.
    return tuple(chosen)


def float8_variables(model: keras.Model) -> dict[str, dict[str, keras.Variable]]:
    """`{layer path: {name: variable}}` of every float8 layer, names `FLOAT8_VARIABLE_NAMES`."""
    return {
        path: {name: getattr(layer, name) for name in FLOAT8_VARIABLE_NAMES}
        for path, layer in _float8_layers(model)
    }


def float8_statistics(model: keras.Model) -> dict[str, Float8LayerStatistics]:
    """The statistics of every float8 layer of `model`, by path; eagerly (reads sync)."""
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


def largest_range_used(variables: Iterable[keras.Variable]) -> Any:
    """The largest `Float8TensorState.range_used` over the float8 state in `variables`.

    `LossScaleOptimizer.step_logs`' `float8_range_used`: a float32 scalar computed in the
    calling graph (no host sync), or None without float8 state.
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

    Quantizes in float32 as Keras' float8 layers do (`values / scale`, clipped, cast);
    `scale` is a float or scalar tensor. Raises `UserInputError` for an unknown format.

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
    if not current.is_traced(saturated):
        return Float8Shares(saturated=float(saturated), underflowed=float(underflowed))
    return Float8Shares(saturated=saturated, underflowed=underflowed)


def format_max(float8_format: str) -> float:
    """The largest finite value of `float8_format` (`e4m3`: 448, `e5m2`: 57344); else refuses."""
    check_choice("float8 format", float8_format, FORMATS)
    return float(ml_dtypes.finfo(FORMATS[float8_format]).max)


def _float8_layers(model: keras.Model) -> list[tuple[str, Any]]:
    return [
        (entry.path, entry.layer) for entry in iter_layer_paths(model) if is_float8(entry.layer)
    ]

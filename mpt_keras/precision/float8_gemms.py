"""Float8 layers whose three GEMMs reach XLA as float8 GEMMs: forward, input and weight gradient.

Keras' float8 `Dense`/`EinsumDense` fake-quantize the input and kernel, multiply the
dequantized values (`convert(float8) * scale`) in the compute dtype and leave the gradients
to autodiff. Compiled for a GPU, XLA's Triton GEMM fusion takes such a dot as a bfloat16 GEMM
and then drops the round trip through float8 (`backend/jax/float8_dots.py`): no GEMM runs in
float8. Here each GEMM is a dot of the float8 values themselves, accumulated in float32 and
multiplied by the two scales after: the input flattened to `[M, K]`, the kernel to `[K, N]`,
and a custom gradient writing the backward GEMMs the same way: forward e4m3 x e4m3, input
gradient e5m2 x e4m3, weight gradient e4m3 x e5m2.

Two scaling recipes, on Keras' own variables (`inputs_scale`, `inputs_amax_history`, ...):
- `delayed`: Keras' (the scale from the amax history of earlier steps), the same numbers to
  the rounding of where the scales multiply;
- `current`: Transformer Engine's `Float8CurrentScaling`, each tensor's scale from its own
  amax in this call (`amax / largest`); the variables record the scale used and the amax.
A `model.keras` holds Keras' float8 layers: loaded without mpt_keras, they run Keras' call.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import keras
import ml_dtypes
from keras import ops

from mpt_keras.backend import current
from mpt_keras.compat.layers import replace_float8_call
from mpt_keras.errors import UserInputError

RECIPES = ("delayed", "current")
DEFAULT_RECIPE = "delayed"
_E4M3 = "float8_e4m3fn"
_E5M2 = "float8_e5m2"
_LARGEST = {name: float(ml_dtypes.finfo(name).max) for name in (_E4M3, _E5M2)}
# Each GEMM's equation on the flattened operands: the name scope it runs in, the role it
# names (the census reads a compiled GEMM's role from it: XLA may split or fuse a GEMM) and
# the dimension each operand contracts.
GEMM_SCOPES = {
    "mk,kn->mn": ("float8_forward", "forward", (1, 0)),
    "mn,kn->mk": ("float8_input_gradient", "input gradient", (1, 1)),
    "mk,mn->kn": ("float8_weight_gradient", "weight gradient", (0, 0)),
}


def install_float8_gemms(layer: keras.layers.Layer, path: str, recipe: str) -> None:
    """Makes the float8 `layer` (at `path`) run `float8_call` with `recipe` from now on."""
    check_installable(layer, path, recipe)
    replace_float8_call(layer, functools.partial(float8_call, layer, recipe=recipe))


def check_installable(layer: keras.layers.Layer, path: str, recipe: str) -> None:
    """Raises `UserInputError` for an unknown recipe, a layer with LoRA enabled (Keras' own
    float8 call refuses LoRA too) or an `EinsumDense` whose equation is not a matrix product
    (a dimension shared by input, kernel and output)."""
    if recipe not in RECIPES:
        raise UserInputError(f"float8 recipe: received '{recipe}'. Allowed: {', '.join(RECIPES)}")
    if getattr(layer, "lora_enabled", False):
        raise UserInputError(_lora_refusal(path))
    equation = _equation(layer)
    if as_matrix_product(_expanded(equation, None)) is None:
        raise UserInputError(
            f"layer '{path}': its equation '{equation}' is not a matrix product (a "
            "dimension shared by input, kernel and output). Allowed for the float8 GEMMs: "
            "equations whose every index is in two of the three terms"
        )


def float8_call(layer: Any, inputs: Any, training: Any = None, *, recipe: str) -> Any:
    """What a float8 `Dense`/`EinsumDense` computes: the GEMMs, then bias and activation."""
    if getattr(layer, "lora_enabled", False):  # Enabled after the install.
        raise UserInputError(_lora_refusal(layer.name))
    equation = _equation(layer)
    # In the compute dtype, as Keras' float8 call: the kernel quantizes from it.
    outputs = einsum_float8(
        equation,
        inputs,
        ops.cast(layer.kernel, layer.compute_dtype),
        {
            tensor: (
                ops.convert_to_tensor(getattr(layer, f"{tensor}_scale")),
                ops.convert_to_tensor(getattr(layer, f"{tensor}_amax_history")),
            )
            for tensor in ("inputs", "kernel", "outputs_grad")
        },
        recipe=recipe,
    )
    if layer.bias is not None:
        bias = layer.bias
        if layer.compute_dtype == "float32":  # As Keras: a bfloat16-rounded bias fuses.
            bias = ops.cast(ops.cast(bias, "bfloat16"), bias.dtype)
        outputs = ops.add(outputs, bias)
    if layer.activation is not None:
        outputs = layer.activation(outputs)
    return outputs


def _lora_refusal(layer: str) -> str:
    return f"layer '{layer}': float8 GEMMs with LoRA enabled. Allowed: LoRA off"


def einsum_float8(
    equation: str, inputs: Any, kernel: Any, state: dict[str, tuple[Any, Any]], recipe: str
) -> Any:
    """`einsum(equation, inputs, kernel)` as one `[M, K] x [K, N]` float8 GEMM.

    `state`: `(scale, amax_history)` of `inputs`, `kernel` and `outputs_grad`; their
    gradients are the next values (Keras' `overwrite_with_gradient`).
    """
    product = as_matrix_product(_expanded(equation, len(inputs.shape)))
    if product is None:
        raise UserInputError(f"equation '{equation}': not a matrix product")
    lhs, rhs, out, free_lhs, contracted, free_rhs = product
    inputs_2d, lhs_shape = _as_matrix(inputs, lhs, free_lhs, contracted)
    kernel_2d, _ = _as_matrix(kernel, rhs, contracted, free_rhs)
    rhs_sizes = [kernel.shape[rhs.index(index)] for index in free_rhs]
    outputs_2d = _gemms(recipe)(
        inputs_2d, kernel_2d, *state["inputs"], *state["kernel"], *state["outputs_grad"]
    )
    order = free_lhs + free_rhs
    outputs = ops.reshape(outputs_2d, tuple(lhs_shape) + tuple(rhs_sizes))
    permutation = [order.index(index) for index in out]
    if permutation != sorted(permutation):
        outputs = ops.transpose(outputs, permutation)
    return outputs


def gemm_shape(layer: Any, input_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """`(M, K, N)` of the float8 GEMM `layer` runs on inputs of `input_shape`; None where its
    equation is not one matrix product."""
    product = as_matrix_product(_expanded(_equation(layer), len(input_shape)))
    if product is None:
        return None
    lhs, rhs, _, free_lhs, contracted, free_rhs = product
    kernel_shape = tuple(layer.kernel.shape)
    inner = math.prod(kernel_shape[rhs.index(index)] for index in contracted)
    columns = math.prod(kernel_shape[rhs.index(index)] for index in free_rhs)
    rows = math.prod(input_shape[lhs.index(index)] for index in free_lhs)
    return rows, inner, columns


def as_matrix_product(equation: str) -> tuple[str, str, str, str, str, str] | None:
    """`(lhs, rhs, out, free lhs, contracted, free rhs)` indices of a two-term `equation`
    without `...`, or None where it is no matrix product (a batch index, a repeated one,
    an index summed within one term)."""
    try:
        terms, out = equation.replace(" ", "").split("->")
        lhs, rhs = terms.split(",")
    except ValueError:
        return None
    if "." in lhs + rhs + out:
        return None  # Expanded by `_expanded` once the input's rank is known.
    if any(len(set(term)) != len(term) for term in (lhs, rhs, out)):
        return None
    free_lhs = "".join(index for index in lhs if index in out and index not in rhs)
    contracted = "".join(index for index in lhs if index in rhs and index not in out)
    free_rhs = "".join(index for index in rhs if index in out and index not in lhs)
    if (
        len(free_lhs) + len(contracted) != len(lhs)
        or len(contracted) + len(free_rhs) != len(rhs)
        or sorted(out) != sorted(free_lhs + free_rhs)
        or not contracted
    ):
        return None
    return lhs, rhs, out, free_lhs, contracted, free_rhs


def _equation(layer: Any) -> str:
    """A `Dense` as the einsum it is (`...a,ab->...b`), an `EinsumDense` its own."""
    return getattr(layer, "equation", None) or "...a,ab->...b"


def _expanded(equation: str, rank: int | None) -> str:
    """`equation` with its `...` written as indices, for an input of `rank` (None: as one)."""
    if "..." not in equation:
        return equation
    lhs = equation.split(",")[0]
    unused = [chr(c) for c in range(ord("A"), ord("Z") + 1) if chr(c) not in equation]
    filler = "".join(unused[: 1 if rank is None else rank - (len(lhs) - 3)])
    return equation.replace("...", filler)


def _as_matrix(tensor: Any, term: str, rows: str, columns: str) -> tuple[Any, list[Any]]:
    """`tensor` (indices `term`) as `[prod(rows), prod(columns)]`, and its rows' sizes."""
    order = [term.index(index) for index in rows + columns]
    if order != sorted(order):
        tensor = ops.transpose(tensor, order)
    shape = ops.shape(tensor)
    row_sizes = list(shape[: len(rows)])
    column_size = 1
    for size in shape[len(rows) :]:
        column_size = column_size * size
    return ops.reshape(tensor, (-1, column_size)), row_sizes


def _quantized(values: Any, scale: Any, dtype: str, compute_dtype: str) -> Any:
    """`values / scale`, clipped to the format's range, in float8 (as Keras quantizes: the
    scale and the bounds in the compute dtype, `values` in theirs)."""
    largest = ops.cast(_LARGEST[dtype], compute_dtype)
    scaled = ops.divide(values, ops.cast(scale, compute_dtype))
    return ops.cast(ops.clip(scaled, -largest, largest), dtype)


def _product(equation: str, lhs: Any, rhs: Any, lhs_scale: Any, rhs_scale: Any, dtype: str) -> Any:
    """`equation` (one of `GEMM_SCOPES`) of the float8 `lhs` and `rhs`, times both scales
    (in float32: a float16 sum of float8 values, up to 448 each, overflows), in `dtype`."""
    scope, _, contracting = GEMM_SCOPES[equation]
    with keras.name_scope(scope):
        product = current.float8_dot(lhs, rhs, contracting, dtype)
        scale = ops.multiply(ops.cast(lhs_scale, "float32"), ops.cast(rhs_scale, "float32"))
        return ops.cast(ops.multiply(product, scale), dtype)


def _amax(values: Any) -> Any:
    return ops.cast(ops.max(ops.abs(values)), "float32")


def _scale_from(amax: Any, scale: Any, dtype: str) -> Any:
    """Keras' rule: `amax / largest`, or `scale` where `amax` is 0 or not finite."""
    return keras.quantizers.compute_float8_scale(amax, scale, ops.cast(_LARGEST[dtype], "float32"))


def _history_with(values: Any, history: Any) -> Any:
    return keras.quantizers.compute_float8_amax_history(values, history)


@functools.cache
def _gemms(recipe: str):
    """The custom-gradient GEMM of `recipe` (one per recipe, so traces share it)."""

    @ops.custom_gradient
    def gemm(inputs, kernel, x_scale, x_history, k_scale, k_history, g_scale, g_history):
        dtype = kernel.dtype  # The compute dtype.
        if recipe == "current":
            x_scale = _scale_from(_amax(inputs), x_scale, _E4M3)
            k_scale = _scale_from(_amax(kernel), k_scale, _E4M3)
        x = _quantized(inputs, x_scale, _E4M3, dtype)
        k = _quantized(kernel, k_scale, _E4M3, dtype)
        outputs = _product("mk,kn->mn", x, k, x_scale, k_scale, dtype)
        scope = current.backward_scope()

        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            with scope():
                return backward(upstream)

        def backward(upstream):
            if recipe == "current":
                used_g_scale = _scale_from(_amax(upstream), g_scale, _E5M2)
                new_scales = (x_scale, k_scale, used_g_scale)
            else:
                used_g_scale = g_scale
                new_scales = tuple(
                    _scale_from(ops.max(history, axis=0), scale, fmt)
                    for scale, history, fmt in (
                        (x_scale, x_history, _E4M3),
                        (k_scale, k_history, _E4M3),
                        (g_scale, g_history, _E5M2),
                    )
                )
            g = _quantized(upstream, used_g_scale, _E5M2, dtype)
            inputs_grad = _product("mn,kn->mk", g, k, used_g_scale, k_scale, inputs.dtype)
            kernel_grad = _product("mk,mn->kn", x, g, x_scale, used_g_scale, dtype)
            return (
                inputs_grad,
                kernel_grad,
                new_scales[0],
                _history_with(inputs, x_history),
                new_scales[1],
                _history_with(kernel, k_history),
                new_scales[2],
                _history_with(upstream, g_history),
            )

        return outputs, grad

    return gemm

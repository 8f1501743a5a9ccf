"""FLOPs of a train step, counted from the static shapes of the traced forward graph.

A train step is 3x the forward pass's matrix products (the backward pass has
two products per one: inputs' and weights' gradients), the usual estimate.
Elementwise work is not counted: the matmul peak does not measure it. The graph is
TensorFlow's (`tf.function`), or on Keras' JAX backend the jaxpr of `model.stateless_call`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import keras

from mpt_keras.backend import current

TRAIN_STEP_FORWARD_MULTIPLE = 3
METHOD = (
    "3 x the forward pass's matrix-product FLOPs (MatMul, BatchMatMul, Einsum, Conv2D, Conv3D, "
    "DepthwiseConv2dNative; on JAX dot_general and conv_general_dilated; "
    "2 per multiply-add), counted from the static shapes of its traced graph; "
    "elementwise ops and the optimizer update not counted"
)


def train_step_flops(model: keras.Model, input_spec: Any) -> int:
    """FLOPs of one train step of the built `model` on a batch of `input_spec`.

    Args:
        input_spec: A `tf.TensorSpec` (batch dimension included), or a dict,
            list or tuple of them, as a batched dataset's `element_spec`; on JAX
            `jax.ShapeDtypeStruct`s.

    Raises:
        ValueError: If a product's shape is not static, or an einsum is not
            one this module counts.
    """
    if current.is_jax():
        return TRAIN_STEP_FORWARD_MULTIPLE * _jaxpr_flops(_forward_jaxpr(model, input_spec))
    import tensorflow as tf

    forward = tf.function(lambda inputs: model(inputs, training=True))
    graph = forward.get_concrete_function(input_spec).graph
    return TRAIN_STEP_FORWARD_MULTIPLE * product_flops(graph.get_operations())


def _forward_jaxpr(model: keras.Model, input_spec: Any) -> Any:
    """The jaxpr of the model's forward pass in training, traced from shapes alone."""
    import jax

    def forward(trainable: Any, non_trainable: Any, inputs: Any) -> Any:
        return model.stateless_call(trainable, non_trainable, inputs, training=True)[0]

    def shapes(variables: Iterable[Any]) -> list[Any]:
        return [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in variables]

    return jax.make_jaxpr(forward)(
        shapes(model.trainable_variables), shapes(model.non_trainable_variables), input_spec
    ).jaxpr


def _jaxpr_flops(jaxpr: Any) -> int:
    """FLOPs of the products in `jaxpr` and the jaxprs inside it (each counted once)."""
    total = 0
    for equation in jaxpr.eqns:
        kind = equation.primitive.name
        if kind in ("dot_general", "conv_general_dilated"):
            left, right = (variable.aval.shape for variable in equation.invars[:2])
            elements = math.prod(equation.outvars[0].aval.shape)
            if kind == "dot_general":
                (contracted, _), _ = equation.params["dimension_numbers"]
                total += 2 * elements * math.prod(left[d] for d in contracted)
            else:  # The kernel's input features (of a group) and spatial sizes.
                kernel_spec = equation.params["dimension_numbers"].rhs_spec
                total += 2 * elements * math.prod(right[d] for d in kernel_spec[1:])
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # A ClosedJaxpr's.
                if hasattr(inner, "eqns"):
                    total += _jaxpr_flops(inner)
    return total


def product_flops(operations: Iterable[Any]) -> int:
    """FLOPs of the matrix products among `operations`, 2 per multiply-add."""
    return sum(_flops(operation) for operation in operations)


def _flops(operation: Any) -> int:
    kind = operation.type
    if kind == "MatMul":
        left = _shape(operation.inputs[0])
        contracted = left[0] if operation.get_attr("transpose_a") else left[1]
        return 2 * _elements(operation.outputs[0]) * contracted
    if kind in ("BatchMatMulV2", "BatchMatMulV3"):
        left = _shape(operation.inputs[0])
        contracted = left[-2] if operation.get_attr("adj_x") else left[-1]
        return 2 * _elements(operation.outputs[0]) * contracted
    if kind in ("Conv2D", "Conv3D"):
        # Kernel: spatial sizes, input channels (of a group), output channels.
        return 2 * _elements(operation.outputs[0]) * math.prod(_shape(operation.inputs[1])[:-1])
    if kind == "DepthwiseConv2dNative":
        # An output element reads one input channel.
        height, width, _, _ = _shape(operation.inputs[1])
        return 2 * _elements(operation.outputs[0]) * height * width
    if kind == "Einsum":
        return _einsum_flops(operation)
    return 0


def _einsum_flops(operation: Any) -> int:
    inputs = operation.get_attr("equation").decode().split("->")[0].split(",")
    if len(inputs) != 2 or "." in operation.get_attr("equation").decode():
        raise ValueError(
            "Only two-operand einsums without an ellipsis are counted. "
            f"Received: equation={operation.get_attr('equation').decode()!r}"
        )
    sizes: dict[str, int] = {}
    for labels, tensor in zip(inputs, operation.inputs, strict=True):
        sizes.update(zip(labels, _shape(tensor), strict=True))
    return 2 * math.prod(sizes.values())


def _shape(tensor: Any) -> list[int]:
    shape = tensor.shape.as_list()
    if None in shape:
        raise ValueError(
            f"FLOPs need static shapes. Received: {tensor.name} of shape {tensor.shape}"
        )
    return shape


def _elements(tensor: Any) -> int:
    return math.prod(_shape(tensor))

"""FLOPs of a train step, counted from the static shapes of the traced forward graph.

A train step is 3x the forward pass's matrix products (the backward pass has
two products per one: inputs' and weights' gradients), the usual estimate.
Elementwise work is not counted: the matmul peak does not measure it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf

TRAIN_STEP_FORWARD_MULTIPLE = 3
METHOD = (
    "3 x the forward pass's matrix-product FLOPs (MatMul, BatchMatMul, Einsum, Conv2D, Conv3D, "
    "DepthwiseConv2dNative; "
    "2 per multiply-add), counted from the static shapes of its traced graph; "
    "elementwise ops and the optimizer update not counted"
)


def train_step_flops(model: keras.Model, input_spec: Any) -> int:
    """FLOPs of one train step of the built `model` on a batch of `input_spec`.

    Args:
        input_spec: A `tf.TensorSpec` (batch dimension included), or a dict,
            list or tuple of them, as a batched dataset's `element_spec`.

    Raises:
        ValueError: If a product's shape is not static, or an einsum is not
            one this module counts.
    """
    forward = tf.function(lambda inputs: model(inputs, training=True))
    graph = forward.get_concrete_function(input_spec).graph
    return TRAIN_STEP_FORWARD_MULTIPLE * product_flops(graph.get_operations())


def product_flops(operations: Iterable[tf.Operation]) -> int:
    """FLOPs of the matrix products among `operations`, 2 per multiply-add."""
    return sum(_flops(operation) for operation in operations)


def _flops(operation: tf.Operation) -> int:
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


def _einsum_flops(operation: tf.Operation) -> int:
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


def _shape(tensor: tf.Tensor) -> list[int]:
    shape = tensor.shape.as_list()
    if None in shape:
        raise ValueError(
            f"FLOPs need static shapes. Received: {tensor.name} of shape {tensor.shape}"
        )
    return shape


def _elements(tensor: tf.Tensor) -> int:
    return math.prod(_shape(tensor))

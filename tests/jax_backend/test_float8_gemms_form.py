"""Our float8 GEMMs reach XLA as dots of float8 operands, read from the program JAX lowers
(before XLA optimizes it), on a CPU.

XLA's GPU compiler keeps a GEMM in float8 only where the dot's operands are float8 as it
meets them: Keras' dots of dequantized operands (`convert(float8) * scale`) become bfloat16
GEMMs there, their float8 rounding dropped (tests/jax_backend/test_float8_census_for_a_gpu.py
compiles both for an H100). Two Dense layers on a `[batch, tokens, width]` input: ours give 5
dots of float8 operands into float32 (2 forward e4m3 x e4m3, 1 input gradient e5m2 x e4m3, 2
weight gradients e4m3 x e5m2); Keras' own multiply bfloat16 operands, and their weight
gradients contract two dimensions.
"""

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np

from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.policies import global_policy

_DOT = re.compile(
    r"stablehlo\.dot_general %\w+, %\w+, contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]"
    r".*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\) -> tensor<[\dx]*x(\w+)>"
)


def _lowered(ours: bool) -> str:
    keras.utils.set_random_seed(0)
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((8, 16))
        hidden = keras.layers.Dense(24, name="up")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(16, name="down")(hidden))
    if ours:
        to_float8(model, ["up", "down"])
    else:
        for name in ("up", "down"):
            model.get_layer(name).quantize("float8")
    fixed = [v.value for v in model.non_trainable_variables]

    def loss(trainable, x):
        y, _ = model.stateless_call(trainable, fixed, x, training=True)
        return jnp.sum(y.astype("float32"))

    x = np.ones((4, 8, 16), "float32")
    trainable = [v.value for v in model.trainable_variables]
    return jax.jit(jax.value_and_grad(loss)).lower(trainable, x).as_text()


def _dots(text: str) -> list[tuple[str, ...]]:
    """Each dot: `(lhs contracting, rhs contracting, lhs type, rhs type, result type)`."""
    return [match.groups() for match in map(_DOT.search, text.splitlines()) if match]


def test_our_three_gemms_are_each_one_dot_of_float8_operands():
    assert sorted(_dots(_lowered(ours=True))) == [
        ("0", "0", "f8E4M3FN", "f8E5M2", "f32"),  # Weight gradients: x^T g.
        ("0", "0", "f8E4M3FN", "f8E5M2", "f32"),
        ("1", "0", "f8E4M3FN", "f8E4M3FN", "f32"),  # Forward: x k.
        ("1", "0", "f8E4M3FN", "f8E4M3FN", "f32"),
        ("1", "1", "f8E5M2", "f8E4M3FN", "f32"),  # The input gradient of `down`: g k^T.
    ]


def test_keras_own_dots_multiply_dequantized_bfloat16_and_contract_two_dimensions():
    dots = _dots(_lowered(ours=False))
    assert {(lhs_type, rhs_type) for _, _, lhs_type, rhs_type, _ in dots} == {("bf16", "bf16")}
    contracting = sorted((lhs, rhs) for lhs, rhs, *_ in dots)
    assert contracting.count(("0, 1", "0, 1")) == 2

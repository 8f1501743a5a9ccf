"""Our float8 GEMMs reach XLA in the form its GPU rewriter takes, read from the program JAX
lowers (before XLA optimizes it), on a CPU.

XLA's `gemm_rewriter` makes a dot a cuBLASLt float8 GEMM when each operand is
`multiply(convert(float8), broadcast(scalar scale))` and the dot contracts one dimension of
rank-2 operands (`MatchFp8Param`, `CreateF8CustomCall`). Two Dense layers on a
`[batch, tokens, width]` input: ours give 5 such dots (2 forward e4m3 x e4m3, 1 input
gradient e5m2 x e4m3, 2 weight gradients e4m3 x e5m2); Keras' own weight gradients contract
two dimensions. Whether the rewrite then happens needs a GPU (the census there).
"""

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np

from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.policies import global_policy

_DEFINITION = re.compile(r"^\s*(%[\w#]+) = (\S+) (.*)$")
_DOT = re.compile(r"dot_general (%\w+), (%\w+), contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]")


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


def _float8_operand(name: str, definitions: dict[str, tuple[str, str]]) -> str | None:
    """The float8 type of `name` if it is `multiply(convert(float8), broadcast(scalar))`."""
    op, rest = definitions.get(name, ("", ""))
    if op != "stablehlo.multiply":
        return None
    found = None
    for operand in re.findall(r"%\w+", rest.split(":")[0]):
        kind, text = definitions.get(operand, ("", ""))
        source = re.search(r"\(tensor<[\dx]*x(f8E\w+)>\)", text)
        if kind == "stablehlo.convert" and source:
            found = source.group(1)
        elif kind == "stablehlo.broadcast_in_dim" and "(tensor<bf16>)" not in text:
            return None  # Not a scalar's broadcast.
    return found


def _dots(text: str) -> list[tuple[str, str, str | None, str | None]]:
    """Each dot: `(lhs contracting, rhs contracting, lhs float8 type, rhs float8 type)`."""
    definitions = {}
    for line in text.splitlines():
        match = _DEFINITION.match(line)
        if match:
            definitions[match.group(1)] = (match.group(2), match.group(3))
    dots = []
    for op, rest in definitions.values():
        match = _DOT.match(f"{op.removeprefix('stablehlo.')} {rest}")
        if op == "stablehlo.dot_general" and match:
            lhs, rhs, lhs_dims, rhs_dims = match.groups()
            dots.append(
                (
                    lhs_dims,
                    rhs_dims,
                    _float8_operand(lhs, definitions),
                    _float8_operand(rhs, definitions),
                )
            )
    return dots


def test_our_three_gemms_are_each_one_dequantized_float8_dot():
    assert sorted(_dots(_lowered(ours=True))) == [
        ("0", "0", "f8E4M3FN", "f8E5M2"),  # Weight gradients: x^T g.
        ("0", "0", "f8E4M3FN", "f8E5M2"),
        ("1", "0", "f8E4M3FN", "f8E4M3FN"),  # Forward: x k.
        ("1", "0", "f8E4M3FN", "f8E4M3FN"),
        ("1", "1", "f8E5M2", "f8E4M3FN"),  # The input gradient of `down`: g k^T.
    ]


def test_keras_own_weight_gradients_contract_two_dimensions():
    contracting = sorted((lhs, rhs) for lhs, rhs, _, _ in _dots(_lowered(ours=False)))
    assert contracting.count(("0, 1", "0, 1")) == 2

"""Forward parity of a float8 candidate, on either backend: each float8 layer is compared.

Keras runs a float8 layer's `quantized_call`, never its `call`, so forward parity watches the
method each layer runs (`calls_wrapped`); before, a float8 layer inside a block went
"not called", and its drift showed up at the next layer compared. The reference Transformer
(one block) in `mixed_bfloat16`, three layers in float8: the attention's query (inside the
attention, inside the block: a sublayer), the MLP's first Dense (inside the block) and the
logits (a graph call).
"""

import keras
import numpy as np
import pytest

from mpt_keras.models.transformer import build_transformer_lm
from mpt_keras.precision.float8 import to_float8
from mpt_keras.validation.forward_parity import forward_parity
from mpt_keras.validation.parity_rows import UnreachedLayer

FLOAT8 = ("block_0/attention/query", "block_0/mlp_up", "logits")
# Beside the attention's fused kernel (as in bfloat16): tests/test_validation_forward_parity.py.
FUSED = ("block_0/attention/_softmax", "block_0/attention/_dropout_layer")


def _build():
    keras.utils.set_random_seed(0)
    return build_transformer_lm(64, 16, num_layers=1, d_model=32, num_heads=2)


@pytest.fixture(scope="module")
def parity():
    tokens = np.random.default_rng(0).integers(0, 64, (4, 16)).astype("int32")
    baseline = _build()
    baseline(tokens)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        candidate = _build()
        candidate(tokens)
        to_float8(candidate, FLOAT8)
    finally:
        keras.config.set_dtype_policy("float32")
    return forward_parity(baseline, candidate, [tokens])


def test_every_float8_layer_is_compared_and_named_float8(parity):
    rows = {row.path: row for row in parity.layers}
    assert {path for path, row in rows.items() if row.compute_dtype == "float8"} == set(FLOAT8)
    assert {row.compute_dtype for path, row in rows.items() if path not in FLOAT8} == {"bfloat16"}
    reason = "not called inside 'block_0/attention', which holds it, when the model ran"
    assert parity.unreached == tuple(UnreachedLayer(path, reason) for path in FUSED)


def test_the_drift_enters_at_the_float8_layers_by_e4m3s_rounding(parity):
    """e4m3 keeps 3 bits of mantissa (bfloat16 7): each operand rounds by up to 2**-4.

    Measured (TF; JAX): query 0.037; 0.038, mlp_up 0.019; 0.023, logits 0.013; 0.014, every
    other layer at most 0.0033. A block, or the attention, holding a float8 layer jumps with
    it: its jump is its sublayers'.
    """
    jumps = {row.path: row.error_jump for row in parity.layers}
    holders = {path for path in jumps if any(f.startswith(path + "/") for f in FLOAT8)}
    assert holders == {"block_0", "block_0/attention"}
    widest = max(jump for path, jump in jumps.items() if path not in FLOAT8 + tuple(holders))
    assert widest < 0.005
    for path in FLOAT8:
        assert 0.01 < jumps[path] < 0.05, (path, jumps[path])

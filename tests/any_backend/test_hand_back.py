"""A normalization set apart from the block calling it hands its output back in the block's
compute dtype, on either backend.

A post-norm block (as keras_hub's BERT `TransformerEncoder`) adds its norm's output to its
other tensors with a raw `+`. With the norm float32 (the safe default) in a bfloat16 block,
TensorFlow raised on that `+` ("cannot compute AddV2"), and JAX promoted the block's output,
and all after it, to float32.
"""

import keras
import numpy as np
import pytest
from toy_layers import PostNormBlock

import mpt_keras
from mpt_keras import compat
from mpt_keras.precision.hand_back import HandBack, hand_back, hand_back_of, handed_back_dtype

BFLOAT16 = mpt_keras.PrecisionManifest.from_dict({"version": 1, "default": "mixed_bfloat16"})
# LayerNormalization of [1, 2, 3, 4] (epsilon 1e-3, gamma 1, beta 0) is [-1.3411, -0.4470,
# 0.4470, 1.3411] in float32; rounded to bfloat16 (8 significant bits):
NORMALIZED_IN_BFLOAT16 = [-1.34375, -0.447265625, 0.447265625, 1.34375]


class NormOutputModel(keras.Model):
    """A subclassed model whose last layer, a norm, makes its output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="dense")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, inputs):
        return self.norm(self.dense(inputs))


def _model() -> keras.Model:
    inputs = keras.Input((4,))
    block = PostNormBlock("identity", name="block")(inputs)
    normed = keras.layers.LayerNormalization(name="final_norm")(block)
    return keras.Model(inputs, keras.layers.Dense(2, name="logits")(normed))


def _x() -> np.ndarray:
    return np.array([[1.0, 2.0, 3.0, 4.0]], "float32")


def test_a_post_norm_block_runs_and_stays_in_its_dtype():
    model = _model()
    report = BFLOAT16.apply(model)

    outputs = {layer.path: layer.output_dtype for layer in report.layers}
    assert outputs == {
        "block": "bfloat16",  # Not float32: the norm hands back bfloat16.
        "block/norm": "bfloat16",
        "block/inner": "bfloat16",
        "final_norm": "float32",  # In the model's graph: the next layer casts its inputs.
        "logits": "float32",
    }
    assert {layer.path: layer.returns_dtype for layer in report.layers} == {
        "block": None,
        "block/norm": "bfloat16",
        "block/inner": None,
        "final_norm": None,
        "logits": None,
    }
    assert report.policies["block/norm"] == "float32"
    assert report.output_dtype_mismatches == ()
    row = report.format_table().splitlines()[2].split()
    assert row[:3] + row[-7:] == [
        "block/norm", "LayerNormalization", "float32",
        "normalization", "<-", "returns", "bfloat16", "to", "its", "block",
    ]  # fmt: skip
    assert keras.ops.convert_to_numpy(model(_x())).dtype == np.float32


def test_the_norms_float32_output_is_rounded_once_to_the_blocks_dtype():
    model = _model()
    BFLOAT16.apply(model)
    norm = model.get_layer("block").norm

    handed = norm(_x())
    hand_back(norm, None)
    made = norm(_x())

    assert keras.backend.standardize_dtype(made.dtype) == "float32"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(handed, "float32")), [NORMALIZED_IN_BFLOAT16]
    )
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(made, "bfloat16"), "float32")),
        [NORMALIZED_IN_BFLOAT16],
    )
    # The block's `+`: the identity Dense doubles it, in bfloat16.
    BFLOAT16.apply(model)  # Hands it back again.
    doubled = model.get_layer("block")(_x())
    assert keras.backend.standardize_dtype(doubled.dtype) == "bfloat16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(doubled, "float32")),
        [[2 * value for value in NORMALIZED_IN_BFLOAT16]],
    )


def test_the_dtype_handed_back_follows_policies_set_later():
    # As calibration's trials set them: each layer's own, after the manifest's apply.
    model = _model()
    BFLOAT16.apply(model)
    block = model.get_layer("block")

    for policy in ("mixed_float16", "float32"):
        for layer in (block, block.inner):
            compat.replace_dtype_policy(layer, keras.DTypePolicy(policy))
        dtype = keras.DTypePolicy(policy).compute_dtype
        assert handed_back_dtype(block.norm) == (None if dtype == "float32" else dtype)
        assert keras.backend.standardize_dtype(block(_x()).dtype) == dtype


def test_a_block_making_the_model_output_gets_its_sublayers_outputs_widened():
    # The block is float32 (the model's output), its Dense bfloat16: the `+` takes the
    # Dense's output widened to float32; the norm, float32 as the block, keeps its own.
    inputs = keras.Input((4,))
    model = keras.Model(inputs, PostNormBlock("identity", name="block")(inputs))
    report = BFLOAT16.apply(model)

    assert {layer.path: (layer.policy, layer.returns_dtype) for layer in report.layers} == {
        "block": ("float32", None),
        "block/norm": ("float32", None),
        "block/inner": ("mixed_bfloat16", "float32"),
    }
    assert report.output_dtype_mismatches == ()
    outputs = model(_x())
    assert keras.backend.standardize_dtype(outputs.dtype) == "float32"
    # The norm's float32 output, plus the identity Dense's (its bfloat16 rounding), widened.
    normed = keras.ops.convert_to_numpy(model.get_layer("block").norm(_x()))
    assert normed.dtype == np.float32
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(outputs), normed + np.array([NORMALIZED_IN_BFLOAT16], "float32")
    )
    # Set lower, by a rule, the block computes in bfloat16 too: nothing to widen.
    lower = mpt_keras.PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_bfloat16",
            "rules": [{"match": {"path": "block"}, "policy": "mixed_float16"}],
        }
    )
    lower.apply(model)
    assert handed_back_dtype(model.get_layer("block").inner) is None  # Only ever widened.


def test_nothing_is_handed_back_where_no_block_meets_it():
    subclassed = NormOutputModel()
    subclassed(_x())
    float32_block = _model()
    manifest = mpt_keras.PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_bfloat16",
            "rules": [{"match": {"path": "block"}, "policy": "float32"}],
        }
    )

    BFLOAT16.apply(subclassed)
    manifest.apply(float32_block)

    assert handed_back_dtype(subclassed.norm) is None  # The model's output: the loss reads it.
    assert keras.backend.standardize_dtype(subclassed(_x()).dtype) == "float32"
    assert handed_back_dtype(float32_block.get_layer("block").norm) is None  # One dtype.
    assert handed_back_dtype(float32_block.get_layer("final_norm")) is None  # A graph's.


@pytest.mark.parametrize("own_call", [False, True])
def test_applying_again_wraps_once_and_undoing_keeps_a_call_of_the_users_own(own_call):
    model = _model()
    norm = model.get_layer("block").norm
    if own_call:
        norm.call = keras.layers.LayerNormalization.call.__get__(norm)
    before = vars(norm).get("call")

    BFLOAT16.apply(model)
    BFLOAT16.apply(model)
    assert hand_back_of(norm) == HandBack(model.get_layer("block"))
    # Wrapped once, around the user's own call or the class's.
    own = before if own_call else keras.layers.LayerNormalization.call.__get__(norm)
    assert vars(norm)["call"].__wrapped__ == own
    mpt_keras.PrecisionManifest.from_dict(
        {"version": 1, "default": "mixed_bfloat16", "safe_defaults": False}
    ).apply(model)
    assert handed_back_dtype(norm) is None  # bfloat16 as its block: nothing to hand back.
    hand_back(norm, None)

    assert hand_back_of(norm) is None
    assert vars(norm).get("call") is before


def test_a_sequential_built_after_the_manifest_runs_its_graph_and_hands_nothing_back():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.LayerNormalization(name="norm")]
        + [keras.layers.Dense(2, name="logits")]
    )
    unbuilt = keras.Sequential(model.layers[:], name="unbuilt")  # The same layers.
    report = BFLOAT16.apply(unbuilt)

    unbuilt(_x())

    assert hand_back_of(unbuilt.get_layer("norm")) is None
    assert report.policies["norm"] == "float32"


def test_a_layer_quantized_after_the_manifest_still_hands_back():
    # As benchmarks/stacks.py: `to_float8` after `apply`; Keras then runs `quantized_call`.
    from mpt_keras.precision.float8 import to_float8

    inputs = keras.Input((4,))
    model = keras.Model(inputs, PostNormBlock("identity", name="block")(inputs))
    model(_x())
    BFLOAT16.apply(model)

    to_float8(model, ["block/inner"])

    assert handed_back_dtype(model.get_layer("block").inner) == "float32"
    assert keras.backend.standardize_dtype(model(_x()).dtype) == "float32"


class _AroundANorm(keras.layers.Layer):
    """`normed + dense(normed)` around a norm it is given (shared with another block)."""

    def __init__(self, norm: keras.layers.Layer, **kwargs):
        super().__init__(**kwargs)
        self.norm = norm
        self.dense = keras.layers.Dense(4, name="dense")

    def call(self, inputs):
        normed = self.norm(inputs)
        return normed + self.dense(normed)


def test_a_norm_two_blocks_call_hands_nothing_back():
    shared = keras.layers.LayerNormalization(name="shared_norm")
    inputs = keras.Input((4,))
    first, second = _AroundANorm(shared, name="first"), _AroundANorm(shared, name="second")
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(second(first(inputs))))

    BFLOAT16.apply(model)

    assert hand_back_of(shared) is None  # One dtype could not serve both.
    assert hand_back_of(first.dense) is None


def test_a_layer_and_its_own_call_are_freed_with_the_model():
    import gc
    import weakref

    model = _model()
    norm = model.get_layer("block").norm
    norm.call = keras.layers.LayerNormalization.call.__get__(norm)  # Holds the layer.
    BFLOAT16.apply(model)
    freed = weakref.ref(norm)

    del model, norm
    gc.collect()

    assert freed() is None

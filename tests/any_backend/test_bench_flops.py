"""mpt-bench's FLOPs of a train step: the same exact count from TensorFlow's graph and from
JAX's jaxpr (3x the forward pass's matrix products, 2 FLOPs per multiply-add)."""

from __future__ import annotations

import keras

from benchmarks import flops


def _spec(*shape: int):
    """A batch's input spec as each backend's suite gives it."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.ShapeDtypeStruct(shape, "float32")
    import tensorflow as tf

    return tf.TensorSpec(shape)


def test_train_step_flops_are_3x_the_forward_products():
    inputs = keras.Input((4, 4, 2))
    x = keras.layers.Conv2D(3, 3, padding="same")(inputs)  # 2 * (4*4*3) * (3*3*2) per image
    x = keras.layers.DepthwiseConv2D(3, padding="same")(x)  # 2 * (4*4*3) * (3*3) per image
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(5)(x)  # 2 * 48 * 5 per image
    model = keras.Model(inputs, outputs)
    per_image = 2 * 48 * 18 + 2 * 48 * 9 + 2 * 48 * 5
    assert flops.train_step_flops(model, _spec(2, 4, 4, 2)) == 3 * 2 * per_image


def test_an_einsum_layer_counts_every_distinct_index():
    inputs = keras.Input((5, 4))
    outputs = keras.layers.EinsumDense("btd,df->btf", output_shape=(5, 6))(inputs)
    model = keras.Model(inputs, outputs)
    assert flops.train_step_flops(model, _spec(2, 5, 4)) == 3 * 2 * (2 * 5 * 4 * 6)

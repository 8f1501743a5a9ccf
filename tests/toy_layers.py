"""Small layers that tests build their models from."""

from __future__ import annotations

import keras


class Times(keras.layers.Layer):
    """Multiplies by a constant: an engineered range problem without a Lambda."""

    def __init__(self, factor: float, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor


class Residual(keras.layers.Layer):
    """`inputs + inner(norm(inputs))`, with TensorFlow's `+` as keras_hub's blocks add
    their sublayers' outputs to their residual stream: inner and it take one dtype."""

    def __init__(self, stddev: float, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization(name="norm", dtype=self.dtype_policy)
        kernel = keras.initializers.RandomNormal(stddev=stddev, seed=0)
        self.inner = keras.layers.Dense(
            4, kernel_initializer=kernel, name="inner", dtype=self.dtype_policy
        )

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.inner.build(input_shape)

    def call(self, inputs):
        return inputs + self.inner(self.norm(inputs))


class PostNormBlock(keras.layers.Layer):
    """`normed + inner(normed)` with `normed = norm(inputs)`: the norm's output meets the
    block's in TensorFlow's `+`, as in BERT's post-norm blocks."""

    def __init__(self, kernel_initializer: str = "glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization(name="norm", dtype=self.dtype_policy)
        self.inner = keras.layers.Dense(
            4, kernel_initializer=kernel_initializer, name="inner", dtype=self.dtype_policy
        )

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.inner.build(input_shape)

    def call(self, inputs):
        normed = self.norm(inputs)
        return normed + self.inner(normed)

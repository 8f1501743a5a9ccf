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

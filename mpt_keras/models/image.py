"""Reference image classifiers: a small MLP and a small CNN.

Both end in a `logits` Dense (no softmax: losses take logits): the same path in each.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras


def build_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden_units: Sequence[int] = (128, 64),
    dropout: float = 0.1,
) -> keras.Model:
    """An MLP on flattened images, a functional model named `mlp`.

    Layers: `flatten`, `dense_<i>` (ReLU) and `dropout_<i>` per hidden width, `logits`.
    """
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for index, units in enumerate(hidden_units):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{index}")(x)
        x = keras.layers.Dropout(dropout, name=f"dropout_{index}")(x)
    logits = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="mlp")


def build_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    filters: Sequence[int] = (32, 64),
    dense_units: int = 128,
    dropout: float = 0.2,
) -> keras.Model:
    """A small CNN, a functional model named `cnn`.

    Layers: `conv_<i>` (3x3, ReLU, same padding), each then `pool_<i>` (2x2 max, while the
    map is at least 2x2); `flatten`, `dense` (ReLU), `dropout`, `logits`.
    """
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = inputs
    size = min(input_shape[0], input_shape[1])
    for index, channels in enumerate(filters):
        x = keras.layers.Conv2D(
            channels, 3, padding="same", activation="relu", name=f"conv_{index}"
        )(x)
        if size >= 2:
            x = keras.layers.MaxPooling2D(2, name=f"pool_{index}")(x)
            size //= 2
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="dense")(x)
    x = keras.layers.Dropout(dropout, name="dropout")(x)
    logits = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, logits, name="cnn")

"""Data factories of a user's own, for `"data": {"factory": "examples.user_data:..."}`.

A data factory returns `(train, eval)`: `tf.data.Dataset`s of unbatched
`(x, y)` (or `(x, y, sample_weight)`) elements, or such arrays, `x` an
array or a dict of them (the only kind on Keras' JAX backend); the run
batches, shuffles, shards and repeats them. A third element may declare what
the data decides about the model that its shapes do not show
(`{"num_classes": 10}`). The factories here use data
that ships offline: scikit-learn's handwritten digits and the Python sources
of the standard library (mpt_keras' embedded dataset).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def digits_arrays(seed: int = 0, eval_fraction: float = 0.2):
    """scikit-learn's 1,797 8x8 digits as arrays, for either backend.

    Returns:
        `((x, y), (x, y), {"num_classes": 10})`: images float32 [N, 8, 8, 1] in [0, 1].
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    held_out = int(len(labels) * eval_fraction)
    train, evaluation = order[held_out:], order[:held_out]
    return (
        (images[train], labels[train]),
        (images[evaluation], labels[evaluation]),
        {"num_classes": 10},
    )


def digits_rgb(image_size: int = 32, eval_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 1,797 8x8 digits, resized to `image_size` and given 3 channels.

    Args:
        image_size: Height and width of the images (MobileNet takes >= 32).
        eval_fraction: The share of the digits held out for evaluation.
        seed: Seed of the split (the run passes its own).

    Returns:
        `(train, eval, {"num_classes": 10})`: on Keras' JAX backend arrays, its only kind of
        data; on TensorFlow, `tf.data.Dataset`s of the same elements.
    """
    import keras
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    held_out = int(len(labels) * eval_fraction)

    def split(indices: np.ndarray) -> Any:
        resized = keras.ops.image.resize(images[indices], (image_size, image_size))
        rgb = np.repeat(keras.ops.convert_to_numpy(resized), 3, axis=-1)
        if keras.backend.backend() == "jax":
            return rgb, labels[indices]
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((rgb, labels[indices]))

    return split(order[held_out:]), split(order[:held_out]), {"num_classes": 10}


def python_bytes(sequence_length: int = 64):
    """Byte windows of the embedded Python sources, shaped for keras_hub's GPT-2 and Llama.

    On Keras' JAX backend the splits are arrays (`x` a dict of them), its only kind of data;
    on TensorFlow, `tf.data.Dataset`s of the same elements. Either way without TFDS: the
    windows of `mpt_keras.embedded_arrays`, the examples the dataset's TFDS builder stores.

    Returns:
        `(train, eval, {"vocab_size": 256, "sequence_length": sequence_length})`
        with elements `({"token_ids", "padding_mask"}, next_tokens)`.
    """
    import keras

    from mpt_keras import embedded_arrays

    def split(name: str) -> Any:
        texts = [text.encode("utf-8") for _, _, text in embedded_arrays.python_source(name)]
        inputs, targets = embedded_arrays.text_windows(
            texts, sequence_length, "mpt_python_source", name
        )
        features = {"token_ids": inputs, "padding_mask": np.ones_like(inputs, dtype=bool)}
        if keras.backend.backend() == "jax":
            return features, targets
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((features, targets))

    return (
        split("train"),
        split("validation"),
        {"vocab_size": embedded_arrays.VOCAB_SIZE, "sequence_length": sequence_length},
    )

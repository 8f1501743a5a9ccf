"""Deterministic, resumable batching of in-memory arrays.

Training order is a pure function of (seed, position): the example at global
position p = step * batch_size + i is

    index_shuffle(p % N, seed=[seed, p // N], max_index=N - 1)

(`tf.random.experimental.index_shuffle`), so each pass over the data (a "data
epoch", p // N) is a fresh permutation fixed by the seed and the epoch number.
A run resumed at step k therefore continues at the exact data position, even in
the middle of a data epoch, without replaying the steps before it.
"""

import numpy as np
import tensorflow as tf

from mpt_keras.errors import UserInputError


def train_batches(
    features: np.ndarray,
    labels: np.ndarray,
    batch_size: int,
    seed: int,
    start_step: int = 0,
) -> tf.data.Dataset:
    """An infinite stream of shuffled (features, labels) training batches.

    Batches may straddle data epochs. `train_batches(..., start_step=k)` yields
    exactly batches k, k + 1, ... of `train_batches(..., start_step=0)`.

    Args:
        features: Examples along axis 0; their dtype is kept.
        labels: One label per example; their dtype is kept.
        batch_size: Examples per batch, at least 1; every batch is full.
        seed: Shuffling seed, any int64.
        start_step: Index of the first batch to yield, at least 0.

    Returns:
        Batches of static shape [batch_size, ...], prefetched.

    Raises:
        UserInputError: If batch_size < 1, start_step < 0, there are no
            examples, or features and labels differ in length.
    """
    num_examples = _check(features, labels, batch_size)
    if start_step < 0:
        raise UserInputError(f"start_step {start_step} is negative. Allowed: an integer >= 0.")
    first_epoch, first_offset = divmod(start_step * batch_size, num_examples)
    seed_tensor = tf.constant(seed, tf.int64)
    positions = tf.range(num_examples, dtype=tf.int64)

    # One index_shuffle call per data epoch, not per batch: a batch may span
    # epochs, and index_shuffle cannot take one seed per index (it pads a batch
    # of seeds along the wrong axis).
    def epoch_order(epoch: tf.Tensor) -> tf.data.Dataset:
        order = tf.random.experimental.index_shuffle(
            positions, seed=tf.stack([seed_tensor, epoch]), max_index=num_examples - 1
        )
        # A resumed stream starts mid-epoch: drop the positions already consumed.
        skip = tf.where(epoch == first_epoch, first_offset, 0)
        return tf.data.Dataset.from_tensor_slices(order[skip:])

    features = tf.convert_to_tensor(features)
    labels = tf.convert_to_tensor(labels)
    return (
        tf.data.Dataset.counter(first_epoch)
        .flat_map(epoch_order)
        # flat_map hides that the stream never ends; say so for fit() and friends.
        .apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
        .batch(batch_size, drop_remainder=True)
        .map(
            lambda indices: (tf.gather(features, indices), tf.gather(labels, indices)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        .prefetch(tf.data.AUTOTUNE)
    )


def eval_batches(features: np.ndarray, labels: np.ndarray, batch_size: int) -> tf.data.Dataset:
    """One in-order pass over (features, labels), keeping the last partial batch.

    Args:
        features: Examples along axis 0; their dtype is kept.
        labels: One label per example; their dtype is kept.
        batch_size: Examples per batch, at least 1.

    Returns:
        ceil(N / batch_size) batches, prefetched.

    Raises:
        UserInputError: If batch_size < 1, there are no examples, or features
            and labels differ in length.
    """
    _check(features, labels, batch_size)
    return (
        tf.data.Dataset.from_tensor_slices((features, labels))
        .batch(batch_size)
        .prefetch(tf.data.AUTOTUNE)
    )


def _check(features: np.ndarray, labels: np.ndarray, batch_size: int) -> int:
    """Validates the batching inputs and returns the number of examples."""
    if batch_size < 1:
        raise UserInputError(f"batch_size {batch_size} is too small. Allowed: an integer >= 1.")
    num_examples = len(features)
    if num_examples == 0:
        raise UserInputError("The dataset has 0 examples. Allowed: at least 1 example.")
    if len(labels) != num_examples:
        raise UserInputError(
            f"Got {num_examples} examples but {len(labels)} labels. Allowed: one label per example."
        )
    return num_examples

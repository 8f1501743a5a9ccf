"""Deterministic, resumable batching of in-memory arrays in tf.data.

Training order is a pure function of (seed, position): position p = step * batch_size + i
holds example `index_shuffle(p % N, seed=[seed, p // N], max_index=N - 1)`, so each data
epoch is a fresh seeded permutation and a run resumed at step k continues at the exact data
position without replaying.

Both pipelines run with tf.data's autotuning off: slicing arrays held in memory has nothing
to tune, while the tuner's thread costs CPU and a deleted iterator waits for it, seconds to
a minute (measured in docs/architecture.md). A prefetch of AUTOTUNE keeps its own buffer
tuner (`legacy_autotune`); the parallel map keeps its initial parallelism
(`tf.data.Options().autotune.initial_parallelism`, 16 by default).
"""

from typing import Any

import tensorflow as tf

from mpt_keras.checks import batch_parts, check_number

_UNTUNED = tf.data.Options()
_UNTUNED.autotune.enabled = False  # The module docstring says why.


def train_batches(
    features: Any,
    labels: Any,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    sample_weight: Any = None,
) -> tf.data.Dataset:
    """An endless stream of full, shuffled (features, labels) batches, with the same rows of
    `sample_weight` third if given; dtypes kept.

    Batches may straddle data epochs; `start_step=k` yields exactly batches k, k + 1, ... of
    `start_step=0`. `UserInputError`: a bad batch_size or start_step, no examples, or lengths
    differing.
    """
    parts = batch_parts(features, labels, sample_weight, batch_size, _count)
    num_examples = _count(features)
    check_number("start_step", start_step, minimum=0, integer=True)
    first_epoch, first_offset = divmod(start_step * batch_size, num_examples)
    seed_tensor = tf.constant(seed, tf.int64)
    positions = tf.range(num_examples, dtype=tf.int64)

    # One index_shuffle per data epoch, not per batch: a batch may span epochs, and
    # index_shuffle cannot take a seed per index (it pads a seed batch on the wrong axis).
    def epoch_order(epoch: tf.Tensor) -> tf.data.Dataset:
        order = tf.random.experimental.index_shuffle(
            positions, seed=tf.stack([seed_tensor, epoch]), max_index=num_examples - 1
        )
        # A resumed stream starts mid-epoch: drop consumed positions.
        skip = tf.where(epoch == first_epoch, first_offset, 0)
        return tf.data.Dataset.from_tensor_slices(order[skip:])

    # A dict: each input (x) or output (y, sample_weight).
    parts = tf.nest.map_structure(tf.convert_to_tensor, parts)
    return (
        tf.data.Dataset.counter(first_epoch)
        .flat_map(epoch_order)
        # flat_map hides that the stream never ends; tell fit().
        .apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
        .batch(batch_size, drop_remainder=True)
        .map(
            lambda indices: tf.nest.map_structure(lambda array: tf.gather(array, indices), parts),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        .prefetch(tf.data.AUTOTUNE)
        .with_options(_UNTUNED)
    )


def eval_batches(
    features: Any, labels: Any, batch_size: int, sample_weight: Any = None
) -> tf.data.Dataset:
    """One in-order pass over (features, labels[, sample_weight]), keeping the last partial
    batch; refusals as `train_batches`'."""
    return (
        tf.data.Dataset.from_tensor_slices(
            batch_parts(features, labels, sample_weight, batch_size, _count)
        )
        .batch(batch_size)
        .prefetch(tf.data.AUTOTUNE)
        .with_options(_UNTUNED)
    )


def _count(features: Any) -> int:
    """Examples in `features` (or labels): an array, or a dict of arrays of one length (one
    per named input or output, `data.example_arrays`, which this layer may not import)."""
    return len(next(iter(tf.nest.flatten(features)), ()))

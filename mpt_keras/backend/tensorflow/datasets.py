"""A data factory's `tf.data` splits: checked unbatched, shuffled and batched, their dimensions.

TensorFlow's side of `data/sources.py`; a JAX run takes arrays and never imports it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from mpt_keras import compat
from mpt_keras.errors import UserInputError


def checked_dataset(split: tf.data.Dataset, what: str, batching: str) -> tf.data.Dataset:
    """`split` if its elements are unbatched `(x, y[, sample_weight])`; else `UserInputError`
    naming `what` and `batching` (see `sources.checked_split`)."""
    spec = split.element_spec
    if _batched(split):
        shapes = ", ".join(str(tuple(s.shape)) for s in tf.nest.flatten(spec))
        raise UserInputError(
            f"{what}: received a batched tf.data.Dataset (a .batch() in its pipeline; "
            f"elements of shapes {shapes}), but the run batches the data itself "
            f"({batching}). Allowed: unbatched (x, y) or (x, y, sample_weight) elements: "
            "leave out the .batch() (or add .unbatch())"
        )
    if isinstance(spec, tuple) and len(spec) in (2, 3):
        return split
    raise UserInputError(
        f"{what}: elements are {spec}. Allowed: unbatched (x, y) or (x, y, sample_weight) tuples"
    )


def train_batches(
    dataset: tf.data.Dataset, batch_size: int, seed: int, start_step: int, shuffle_buffer: int
) -> tf.data.Dataset:
    """The endless stream of full shuffled batches from `start_step` on (read and skipped)."""
    return (
        dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .batch(batch_size, drop_remainder=True)
        .skip(start_step)
        .prefetch(tf.data.AUTOTUNE)
    )


def eval_batches(dataset: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
    """One in-order pass, the last batch partial."""
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def spec_dimensions(dataset: tf.data.Dataset) -> dict[str, Any]:
    """What an element's input says: its shape, and a token sequence's length."""
    x = dataset.element_spec[0]
    if not isinstance(x, tf.TensorSpec):
        return {}
    dimensions: dict[str, Any] = {"input_shape": tuple(x.shape)}
    if x.dtype.is_integer and x.shape.rank == 1:
        dimensions["sequence_length"] = x.shape[0]
    return dimensions


def _batched(dataset: tf.data.Dataset) -> bool:
    """Whether the pipeline's last batching (or unbatching) step batched it.

    From the chain, not shapes (an unknown-length sequence also has a leading None); several
    inputs: when each is.
    """
    inputs = compat.dataset_inputs(dataset)
    if not inputs:
        return False
    if len(inputs) > 1:
        return all(_batched(each) for each in inputs)
    (source,) = inputs
    ranks = _rank_changes(dataset.element_spec, source.element_spec)
    if ranks == {1}:
        return True
    if ranks == {-1}:
        return False
    return _batched(source)


def _rank_changes(spec: Any, source_spec: Any) -> set[int]:
    """Each component's rank change from `source_spec` to `spec`, trailing dimensions kept
    (empty if structures differ or a rank is unknown)."""
    try:
        pairs = list(zip(tf.nest.flatten(spec), tf.nest.flatten(source_spec), strict=True))
    except ValueError:
        return set()
    changes = set()
    for after, before in pairs:
        after, before = getattr(after, "shape", None), getattr(before, "shape", None)
        if after is None or before is None or after.rank is None or before.rank is None:
            return set()
        change = after.rank - before.rank
        outer, inner = (after, before) if change > 0 else (before, after)
        if abs(change) != 1 or outer[1:].as_list() != inner.as_list():
            return {0}
        changes.add(change)
    return changes


def sharded_by_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset`, split by data (not files) across a multi-worker strategy's workers."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)

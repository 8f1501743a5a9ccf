"""Where a run's data comes from, unbatched: a data factory, a TFDS mapping or a name.

Arrays resume at any step by index (`pipeline`); a `tf.data.Dataset` is shuffled and batched
here, and a resumed run reads and skips the batches before its step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.config import DataConfig
from mpt_keras.config.components import DATA_DIMENSIONS, BoundFactory
from mpt_keras.data import loading, pipeline
from mpt_keras.errors import UserInputError, describe_error


@dataclasses.dataclass(frozen=True)
class RunData:
    """A run's unbatched data, and what it decides about a model.

    `train`, `eval`: arrays `(x, y)` or a `tf.data.Dataset` of `(x, y[, sample_weight])`.
    `dimensions`: what the data decides (`components.DATA_DIMENSIONS`).
    """

    train: tuple[np.ndarray, ...] | tf.data.Dataset
    eval: tuple[np.ndarray, ...] | tf.data.Dataset
    dimensions: Mapping[str, Any]

    def train_batches(
        self, batch_size: int, seed: int, start_step: int = 0, shuffle_buffer: int = 10_000
    ) -> tf.data.Dataset:
        """The endless stream of full train batches from `start_step` on."""
        if isinstance(self.train, tf.data.Dataset):
            return (
                self.train.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
                .repeat()
                .batch(batch_size, drop_remainder=True)
                .skip(start_step)
                .prefetch(tf.data.AUTOTUNE)
            )
        return pipeline.train_batches(*self.train, batch_size, seed=seed, start_step=start_step)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """One in-order pass over the evaluation data, the last batch partial."""
        if isinstance(self.eval, tf.data.Dataset):
            return self.eval.batch(batch_size).prefetch(tf.data.AUTOTUNE)
        return pipeline.eval_batches(*self.eval, batch_size)

    def subset(self, train_examples: int, eval_examples: int) -> RunData:
        """The first examples of each split (the canary's small run)."""
        return RunData(
            _first(self.train, train_examples), _first(self.eval, eval_examples), self.dimensions
        )


def load_run_data(
    source: DataConfig, seed: int, shape: str | None, factory: BoundFactory | None
) -> RunData:
    """Loads a run's data from where its config says: a factory, a mapping, or a name.

    `shape`: for a dataset named without `features`, `"image"` or `"text"` (None: its own).
    `factory`: the bound `data.factory`, if any.
    """
    if factory is not None:
        loaded = _from_data_factory(factory, seed, f"data.batch_size: {source.batch_size}")
    elif source.features is not None:
        loaded = _from_tfds_features(source)
    else:
        loaded = _from_reference_shapes(source, shape)
    if source.eval_examples:
        loaded = dataclasses.replace(loaded, eval=_first(loaded.eval, source.eval_examples))
    return loaded


def _from_reference_shapes(source: DataConfig, shape: str | None) -> RunData:
    """A dataset in the reference shapes: images and labels, or text."""
    if shape is None:
        shape = loading.reference_shape(source.name, source.train_split, source.data_dir)
    if shape == "image":
        train = loading.classification_arrays(source.name, source.train_split, source.data_dir)
        evaluation = loading.classification_arrays(source.name, source.eval_split, source.data_dir)
        return RunData(
            (train.features, train.labels),
            (evaluation.features, evaluation.labels),
            {"input_shape": train.features.shape[1:], "num_classes": train.num_classes},
        )
    windows = functools.partial(
        loading.language_model_windows,
        source.name,
        data_dir=source.data_dir,
        sequence_length=source.sequence_length,
    )
    return RunData(
        windows(split=source.train_split),
        windows(split=source.eval_split),
        {"vocab_size": loading.VOCAB_SIZE, "sequence_length": source.sequence_length},
    )


def _from_tfds_features(source: DataConfig) -> RunData:
    """A TFDS dataset of any shape, by the config's `data.features`."""
    splits = [
        loading.feature_pairs(source.name, split, source.data_dir, source.features)
        for split in (source.train_split, source.eval_split)
    ]
    (train, dimensions), (evaluation, _) = splits
    return RunData(train, evaluation, {**_spec_dimensions(train), **dimensions})


def _from_data_factory(factory: BoundFactory, seed: int, batching: str) -> RunData:
    what = f"data.factory {factory.reference}"
    try:
        returned = factory(seed=seed)
    except UserInputError:
        raise
    except Exception as error:  # The user's code: its error, in one line.
        raise UserInputError(f"{what} failed: {describe_error(error)}") from None
    if not (isinstance(returned, tuple) and len(returned) in (2, 3)):
        raise UserInputError(
            f"{what} returned {type(returned).__name__}. Allowed: (train, eval) tf.data.Datasets, "
            "optionally with a third element, a dict of dimensions such as {'num_classes': 10}"
        )
    train = checked_split(returned[0], f"{what}: train", batching)
    evaluation = checked_split(returned[1], f"{what}: eval", batching)
    declared = returned[2] if len(returned) == 3 else {}
    if not isinstance(declared, Mapping) or set(declared) - set(DATA_DIMENSIONS):
        raise UserInputError(
            f"{what}: its dimensions {declared!r} are not a dict of known names. "
            f"Allowed: a dict with keys among {', '.join(DATA_DIMENSIONS)}"
        )
    return RunData(train, evaluation, {**_spec_dimensions(train), **declared})


def checked_split(split: Any, what: str, batching: str) -> tuple[np.ndarray, ...] | tf.data.Dataset:
    """`split` if a run takes it: a dataset of `(x, y[, sample_weight])` or `(x, y)` arrays.

    `what` (its origin) and `batching` (the batching setting, `data.batch_size: 32`, for an
    already batched dataset) name it in the `UserInputError`.
    """
    if isinstance(split, tf.data.Dataset):
        spec = split.element_spec
        if _batched(split):
            shapes = ", ".join(str(tuple(s.shape)) for s in tf.nest.flatten(spec))
            raise UserInputError(
                f"{what}: received a batched tf.data.Dataset (a .batch() in its pipeline; "
                f"elements of shapes {shapes}), but the run batches the data itself "
                f"({batching}). Allowed: unbatched (x, y) elements: leave out the .batch() "
                "(or add .unbatch())"
            )
        if isinstance(spec, tuple) and len(spec) in (2, 3):
            return split
        raise UserInputError(
            f"{what}: elements are {spec}. Allowed: unbatched (x, y) or (x, y, sample_weight) "
            "tuples"
        )
    if isinstance(split, tuple) and len(split) == 2 and len(split[0]) == len(split[1]):
        return tuple(np.asarray(array) for array in split)
    raise UserInputError(
        f"{what}: received {type(split).__name__}. Allowed: a tf.data.Dataset of unbatched "
        "(x, y) elements, or a tuple (x, y) of arrays of equal length"
    )


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


def _spec_dimensions(dataset: tf.data.Dataset) -> dict[str, Any]:
    """What an element's input says: its shape, and a token sequence's length."""
    x = dataset.element_spec[0]
    if not isinstance(x, tf.TensorSpec):
        return {}
    dimensions: dict[str, Any] = {"input_shape": tuple(x.shape)}
    if x.dtype.is_integer and x.shape.rank == 1:
        dimensions["sequence_length"] = x.shape[0]
    return dimensions


def _first(split: tuple[np.ndarray, ...] | tf.data.Dataset, count: int):
    if isinstance(split, tf.data.Dataset):
        return split.take(count)
    return tuple(array[:count] for array in split)

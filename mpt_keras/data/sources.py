"""Where a run's data comes from, unbatched: a data factory, a TFDS mapping or a name.

Arrays resume at any step by index (`pipeline`, or `array_batches` on Keras' JAX backend); a
`tf.data.Dataset` is shuffled and batched in `backend/tensorflow/datasets.py`, and a resumed
run reads and skips the batches before its step. On JAX the data is arrays: the embedded
datasets (without TFDS) or a factory's; a TFDS name or mapping, or a factory's `tf.data`, is
a one-line refusal.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from mpt_keras import embedded_arrays
from mpt_keras.backend import current
from mpt_keras.config import DataConfig
from mpt_keras.config.components import DATA_DIMENSIONS, BoundFactory
from mpt_keras.data import array_batches, example_arrays
from mpt_keras.errors import UserInputError, describe_error

# What a JAX run reads, for its refusals.
_ON_JAX = (
    f"Allowed on Keras' jax backend: data.name {' or '.join(embedded_arrays.EMBEDDED_DATASETS)} "
    f"(splits {' and '.join(embedded_arrays.SPLITS)}), or a data.factory returning (x, y[, "
    "sample_weight]) arrays; TFDS and tf.data need TensorFlow (--backend=tensorflow)"
)


@dataclasses.dataclass(frozen=True)
class RunData:
    """A run's unbatched data, and what it decides about a model.

    `train`, `eval`: arrays `(x, y[, sample_weight])` (x a dict of arrays for named inputs:
    `example_arrays`) or a `tf.data.Dataset` of such elements.
    `dimensions`: what the data decides (`components.DATA_DIMENSIONS`).
    """

    train: tuple[np.ndarray, ...] | Any
    eval: tuple[np.ndarray, ...] | Any
    dimensions: Mapping[str, Any]

    @property
    def labels(self) -> Any:
        """The train labels: arrays (a dict by output name for several), or a dataset's spec."""
        return self.train.element_spec[1] if _is_dataset(self.train) else self.train[1]

    def train_batches(
        self,
        batch_size: int,
        seed: int,
        start_step: int = 0,
        shuffle_buffer: int = DataConfig.shuffle_buffer,
    ) -> Any:
        """The endless stream of full train batches from `start_step` on: a `tf.data.Dataset`,
        or on JAX a generator of NumPy batches."""
        if _is_dataset(self.train):
            from mpt_keras.backend.tensorflow import datasets as tf_datasets

            return tf_datasets.train_batches(
                self.train, batch_size, seed, start_step, shuffle_buffer
            )
        x, y, weights = _batching(self.train)
        if current.is_jax():
            return array_batches.train_batches(x, y, batch_size, seed, start_step, **weights)
        from mpt_keras.backend.tensorflow import batches

        return batches.train_batches(x, y, batch_size, seed=seed, start_step=start_step, **weights)

    def eval_batches(self, batch_size: int) -> Any:
        """One in-order pass over the evaluation data, the last batch partial (re-iterable)."""
        if _is_dataset(self.eval):
            from mpt_keras.backend.tensorflow import datasets as tf_datasets

            return tf_datasets.eval_batches(self.eval, batch_size)
        x, y, weights = _batching(self.eval)
        if current.is_jax():
            return array_batches.eval_batches(x, y, batch_size, **weights)
        from mpt_keras.backend.tensorflow import batches

        return batches.eval_batches(x, y, batch_size, **weights)

    def first_batch(self, batch_size: int) -> tuple[Any, ...]:
        """The train split's first `batch_size` examples in stored order, batched as a step's:
        a step's shapes and dtypes without filling a shuffle buffer (what checks build from)."""
        return tuple(
            next(iter(dataclasses.replace(self, eval=self.train).eval_batches(batch_size)))
        )

    def batch_of_step(
        self, batch_size: int, seed: int, step: int, shuffle_buffer: int = DataConfig.shuffle_buffer
    ) -> tuple[Any, ...]:
        """The global batch of (1-based) `step`: the data is a function of the step."""
        batches = self.train_batches(batch_size, seed, step - 1, shuffle_buffer)
        return tuple(next(iter(batches)))

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
        if current.is_jax():
            raise UserInputError(f"data.features {source.features!r}: a TFDS mapping. {_ON_JAX}")
        loaded = _from_tfds_features(source)
    elif current.is_jax() or _in_memory(source, shape):
        loaded = _embedded_arrays(source)
    else:
        loaded = _from_reference_shapes(source, shape)
    if source.eval_examples:
        loaded = dataclasses.replace(loaded, eval=_first(loaded.eval, source.eval_examples))
    return loaded


def _in_memory(source: DataConfig, shape: str | None) -> bool:
    """Whether a TensorFlow run reads its data from the embedded arrays rather than TFDS: an
    embedded dataset's whole splits, in its own shape. They are the examples its TFDS builder
    stores, in its order (tests/test_embedded_arrays.py), without a TFDS preparation and a
    PNG decode per image per run; a slice (`train[:10%]`) or another shape goes to TFDS."""
    own_shape = embedded_arrays.EMBEDDED_DATASETS.get(source.name)
    return (
        own_shape is not None
        and shape in (None, own_shape)
        and source.train_split in embedded_arrays.SPLITS
        and source.eval_split in embedded_arrays.SPLITS
    )


def _embedded_arrays(source: DataConfig) -> RunData:
    """An embedded dataset as arrays, without TFDS (the same examples as its TFDS builder)."""
    name = source.name
    if name not in embedded_arrays.EMBEDDED_DATASETS:
        raise UserInputError(f"data.name {name!r}: a TFDS dataset. {_ON_JAX}")
    for key in ("train_split", "eval_split"):
        split = getattr(source, key)
        if split not in embedded_arrays.SPLITS:
            raise UserInputError(f"data.{key} {split!r}: a TFDS split or slice. {_ON_JAX}")
    if name == "mpt_digits":
        (train_x, train_y), (eval_x, eval_y) = (
            embedded_arrays.digits(split) for split in (source.train_split, source.eval_split)
        )
        return RunData(
            (_unit_images(train_x), train_y.astype(np.int32)),
            (_unit_images(eval_x), eval_y.astype(np.int32)),
            {"input_shape": train_x.shape[1:], "num_classes": 10},
        )

    def windows(split: str) -> tuple[np.ndarray, np.ndarray]:
        texts = [text.encode("utf-8") for _, _, text in embedded_arrays.python_source(split)]
        return embedded_arrays.text_windows(texts, source.sequence_length, name, split)

    return RunData(
        windows(source.train_split),
        windows(source.eval_split),
        {"vocab_size": embedded_arrays.VOCAB_SIZE, "sequence_length": source.sequence_length},
    )


def _unit_images(images: np.ndarray) -> np.ndarray:
    """uint8 images as float32 in [0, 1], as `loading.classification_arrays` gives them."""
    return images.astype(np.float32) / 255.0


def _from_reference_shapes(source: DataConfig, shape: str | None) -> RunData:
    """A dataset in the reference shapes: images and labels, or text."""
    from mpt_keras.backend.tensorflow import loading

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
        {"vocab_size": embedded_arrays.VOCAB_SIZE, "sequence_length": source.sequence_length},
    )


def _from_tfds_features(source: DataConfig) -> RunData:
    """A TFDS dataset of any shape, by the config's `data.features`."""
    from mpt_keras.backend.tensorflow import datasets as tf_datasets
    from mpt_keras.backend.tensorflow import loading

    splits = [
        loading.feature_pairs(source.name, split, source.data_dir, source.features)
        for split in (source.train_split, source.eval_split)
    ]
    (train, dimensions), (evaluation, _) = splits
    return RunData(train, evaluation, {**tf_datasets.spec_dimensions(train), **dimensions})


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
            f"{what} returned {type(returned).__name__}. Allowed: (train, eval), each an "
            "unbatched tf.data.Dataset or (x, y[, sample_weight]) arrays, optionally with a "
            "third element, a dict of dimensions such as {'num_classes': 10}"
        )
    train = checked_split(returned[0], f"{what}: train", batching)
    evaluation = checked_split(returned[1], f"{what}: eval", batching)
    declared = returned[2] if len(returned) == 3 else {}
    if not isinstance(declared, Mapping) or set(declared) - set(DATA_DIMENSIONS):
        raise UserInputError(
            f"{what}: its dimensions {declared!r} are not a dict of known names. "
            f"Allowed: a dict with keys among {', '.join(DATA_DIMENSIONS)}"
        )
    if _is_dataset(train):
        from mpt_keras.backend.tensorflow import datasets as tf_datasets

        dimensions = tf_datasets.spec_dimensions(train)
    else:
        dimensions = _array_dimensions(train[0])
    return RunData(train, evaluation, {**dimensions, **declared})


def checked_split(split: Any, what: str, batching: str) -> tuple[np.ndarray, ...] | Any:
    """`split` if a run takes it: a dataset or arrays of `(x, y[, sample_weight])`.

    `what` (its origin) and `batching` (the batching setting, `data.batch_size: 32`, for an
    already batched dataset) name it in the `UserInputError`.
    """
    if _is_dataset(split):
        if current.is_jax():
            raise UserInputError(f"{what}: received a tf.data.Dataset. {_ON_JAX}")
        from mpt_keras.backend.tensorflow import datasets as tf_datasets

        return tf_datasets.checked_dataset(split, what, batching)
    if isinstance(split, tuple) and len(split) in (2, 3):
        return example_arrays.checked(split[0], split[1], what, *split[2:])
    received = f"a tuple of {len(split)}" if isinstance(split, tuple) else type(split).__name__
    allowed = "" if current.is_jax() else "a tf.data.Dataset of unbatched elements, or "
    raise UserInputError(
        f"{what}: received {received}. Allowed: {allowed}a tuple (x, y) or (x, y, "
        "sample_weight) of arrays of one length, each an array, a dict of them by name or a "
        "list by position"
    )


def _array_dimensions(x: example_arrays.Features) -> dict[str, Any]:
    """What an array of inputs says, as `tf_datasets.spec_dimensions` for a dataset: an
    example's shape, and a token sequence's length (nothing for a dict or list of inputs)."""
    if not isinstance(x, np.ndarray) or x.ndim < 1 or x.dtype == object:
        return {}
    dimensions: dict[str, Any] = {"input_shape": tuple(x.shape[1:])}
    if np.issubdtype(x.dtype, np.integer) and x.ndim == 2:
        dimensions["sequence_length"] = x.shape[1]
    return dimensions


def _is_dataset(value: Any) -> bool:
    """Whether `value` is a `tf.data.Dataset` (none exists before TensorFlow is imported)."""
    tensorflow = sys.modules.get("tensorflow")
    return tensorflow is not None and isinstance(value, tensorflow.data.Dataset)


def _first(split: Any, count: int) -> Any:
    if _is_dataset(split):
        return split.take(count)
    return tuple(example_arrays.take(part, slice(count)) for part in split)


def _batching(split: tuple[Any, ...]) -> tuple[Any, Any, dict[str, Any]]:
    """Arrays `(x, y[, sample_weight])` as the batchers take them: `x, y, {sample_weight}`."""
    x, y, *weights = split
    return x, y, {"sample_weight": weights[0]} if weights else {}

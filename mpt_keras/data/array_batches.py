"""Deterministic, resumable batching of in-memory arrays without TensorFlow (Keras' JAX backend).

The rule of `backend/tensorflow/batches.py`: position p = step * batch_size + i holds example
`order(p // N)[p % N]`, a fresh seeded permutation per data epoch, so a run resumed at step k
reads batch k next. The permutation here is NumPy's, seeded by `(seed, epoch)`: TensorFlow's
`index_shuffle` draws another order from the same seed, so the two backends see the examples in
different orders.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np

from mpt_keras.checks import batch_parts, check_number
from mpt_keras.data.example_arrays import Features, count, take


def train_batches(
    features: Features,
    labels: Features,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    sample_weight: Features | None = None,
) -> Iterator[tuple[Features, ...]]:
    """An endless stream of full, shuffled `(features, labels)` batches, with the same rows of
    `sample_weight` third if given; dtypes kept.

    `start_step=k` yields exactly batches k, k + 1, ... of `start_step=0`. `UserInputError`:
    as `check_batching`, or a bad start_step.
    """
    parts = batch_parts(features, labels, sample_weight, batch_size, count)
    num_examples = count(features)
    check_number("start_step", start_step, minimum=0, integer=True)
    position = start_step * batch_size
    while True:
        epoch, offset = divmod(position, num_examples)
        indices = []
        while len(indices) < batch_size:
            order = _epoch_order(seed, epoch, num_examples)
            indices.extend(order[offset : offset + batch_size - len(indices)])
            epoch, offset = epoch + 1, 0
        chosen = np.asarray(indices)
        yield tuple(take(part, chosen) for part in parts)
        position += batch_size


def eval_batches(
    features: Features,
    labels: Features,
    batch_size: int,
    sample_weight: Features | None = None,
) -> keras.utils.PyDataset:
    """One in-order pass over `(features, labels[, sample_weight])`, the last batch partial;
    re-iterable."""
    return _InOrder(batch_parts(features, labels, sample_weight, batch_size, count), batch_size)


def batch_of_step(
    features: Features,
    labels: Features,
    batch_size: int,
    seed: int,
    step: int,
    sample_weight: Features | None = None,
) -> tuple[Features, ...]:
    """Batch `step` (0-based) of `train_batches`' stream."""
    return next(
        train_batches(
            features, labels, batch_size, seed, start_step=step, sample_weight=sample_weight
        )
    )


def _epoch_order(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class _InOrder(keras.utils.PyDataset):
    """Batches in stored order (Keras re-reads a `PyDataset` each pass, e.g. each validation)."""

    def __init__(self, parts: tuple[Features, ...], batch_size: int):
        super().__init__()
        self._parts, self._batch_size = parts, batch_size

    def __len__(self) -> int:
        return -(-count(self._parts[0]) // self._batch_size)

    def __getitem__(self, index: int) -> tuple[Features, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of {len(self)}")
        window = slice(index * self._batch_size, (index + 1) * self._batch_size)
        return tuple(take(part, window) for part in self._parts)

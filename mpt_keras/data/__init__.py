"""Datasets: a run's data sources, deterministic batching, offline TFDS loading.

sources.py           RunData: a run's data from a factory, a TFDS mapping or a name
embedded_arrays.py   the embedded datasets' content as arrays (no TFDS): its one home
array_batches.py     deterministic, resumable batching of arrays in NumPy (JAX runs);
                     in tf.data: backend/tensorflow/batches.py
loading.py           TFDS splits, offline, as numpy arrays or unbatched pairs
digits.py            the embedded dataset `mpt_digits` (TFDS builder)
python_source.py     the embedded dataset `mpt_python_source` (TFDS builder)
embedded_builder.py  the embedded builders' shared base

The TFDS and tf.data names load on first use (`loading` registers the embedded builders),
so that a JAX process without TensorFlow imports this package.
"""

import importlib
from typing import TYPE_CHECKING, Any

from mpt_keras.data.embedded_arrays import EMBEDDED_DATASETS, VOCAB_SIZE
from mpt_keras.data.sources import RunData, checked_split, load_run_data

if TYPE_CHECKING:  # what editors and type checkers see; loaded lazily below
    from mpt_keras.backend.tensorflow.batches import eval_batches, train_batches
    from mpt_keras.data.loading import (
        ClassificationData,
        classification_arrays,
        feature_pairs,
        language_model_windows,
        load_split,
        reference_shape,
    )

_LAZY = {
    "ClassificationData": "mpt_keras.data.loading",
    "classification_arrays": "mpt_keras.data.loading",
    "eval_batches": "mpt_keras.backend.tensorflow.batches",
    "feature_pairs": "mpt_keras.data.loading",
    "language_model_windows": "mpt_keras.data.loading",
    "load_split": "mpt_keras.data.loading",
    "reference_shape": "mpt_keras.data.loading",
    "train_batches": "mpt_keras.backend.tensorflow.batches",
}

__all__ = sorted(
    ["EMBEDDED_DATASETS", "RunData", "VOCAB_SIZE", "checked_split", "load_run_data", *_LAZY]
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpt_keras.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

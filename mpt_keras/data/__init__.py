"""Datasets: a run's data sources and deterministic batching.

sources.py           RunData: a run's data from a factory, a TFDS mapping or a name
array_batches.py     deterministic, resumable batching of arrays in NumPy (JAX runs)
example_arrays.py    examples in memory: x, y, sample_weight each an array, dict or list of them

TensorFlow's side lives in backend/tensorflow/: batching in tf.data (batches.py), TFDS
splits loaded offline (loading.py) and the embedded datasets' TFDS builders (digits.py,
python_source.py, embedded_builder.py). The embedded datasets' content is
`mpt_keras/embedded_arrays.py`, below both, so the builders and a JAX run share it.

The TFDS and tf.data names load on first use (`loading` registers the embedded builders),
so that a JAX process without TensorFlow imports this package.
"""

import importlib
from typing import TYPE_CHECKING, Any

from mpt_keras.data.sources import RunData, checked_split, load_run_data
from mpt_keras.embedded_arrays import EMBEDDED_DATASETS, VOCAB_SIZE

if TYPE_CHECKING:  # what editors and type checkers see; loaded lazily below
    from mpt_keras.backend.tensorflow.batches import eval_batches, train_batches
    from mpt_keras.backend.tensorflow.loading import (
        ClassificationData,
        classification_arrays,
        feature_pairs,
        language_model_windows,
        load_split,
        reference_shape,
    )

_LAZY = {
    "ClassificationData": "mpt_keras.backend.tensorflow.loading",
    "classification_arrays": "mpt_keras.backend.tensorflow.loading",
    "eval_batches": "mpt_keras.backend.tensorflow.batches",
    "feature_pairs": "mpt_keras.backend.tensorflow.loading",
    "language_model_windows": "mpt_keras.backend.tensorflow.loading",
    "load_split": "mpt_keras.backend.tensorflow.loading",
    "reference_shape": "mpt_keras.backend.tensorflow.loading",
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

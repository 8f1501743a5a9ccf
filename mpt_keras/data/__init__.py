"""Datasets: offline TFDS loading, a run's data sources, deterministic batching.

loading.py           TFDS splits, offline, as numpy arrays or unbatched pairs
sources.py           RunData: a run's data from a factory, a TFDS mapping or a name
pipeline.py          deterministic, resumable batching of in-memory arrays
digits.py            the embedded dataset `mpt_digits`
python_source.py     the embedded dataset `mpt_python_source`
embedded_builder.py  the embedded builders' shared base

Importing this package registers the embedded builders.
"""

from mpt_keras.data import digits, python_source  # noqa: F401
from mpt_keras.data.loading import (
    EMBEDDED_DATASETS,
    VOCAB_SIZE,
    ClassificationData,
    classification_arrays,
    feature_pairs,
    language_model_windows,
    load_split,
    reference_shape,
)
from mpt_keras.data.pipeline import eval_batches, train_batches
from mpt_keras.data.sources import RunData, checked_split, load_run_data

__all__ = [
    "EMBEDDED_DATASETS",
    "RunData",
    "VOCAB_SIZE",
    "ClassificationData",
    "checked_split",
    "classification_arrays",
    "eval_batches",
    "feature_pairs",
    "language_model_windows",
    "load_run_data",
    "load_split",
    "reference_shape",
    "train_batches",
]

"""The embedded datasets without TFDS (`embedded_arrays.py`) hold what TFDS stores; a run on
either backend reads their whole splits from memory."""

import numpy as np
import pytest

from mpt_keras.backend import current
from mpt_keras.backend.tensorflow import loading
from mpt_keras.config import DataConfig
from mpt_keras.data import load_run_data
from mpt_keras.embedded_arrays import SPLITS


def _data(tfds_dir, name, **options):
    return DataConfig(name=name, data_dir=tfds_dir, sequence_length=16, **options)


def _from_tfds(tfds_dir, name):
    """The whole splits as TFDS stores them, read through `backend/tensorflow/loading.py`."""
    if name == "mpt_digits":
        splits = [loading.classification_arrays(name, s, tfds_dir) for s in SPLITS]
        return [array for split in splits for array in (split.features, split.labels)]
    return [
        array
        for split in SPLITS
        for array in loading.language_model_windows(name, split, tfds_dir, sequence_length=16)
    ]


@pytest.mark.parametrize("name", ["mpt_digits", "mpt_python_source"])
def test_a_run_reads_from_memory_the_examples_tfds_stores(tfds_dir, name):
    ours = load_run_data(_data(tfds_dir, name), seed=0, shape=None, factory=None)
    ours_all = (*ours.train, *ours.eval)
    for array, theirs in zip(ours_all, _from_tfds(tfds_dir, name), strict=True):
        assert array.dtype == theirs.dtype
        np.testing.assert_array_equal(array, theirs)


def test_a_slice_of_an_embedded_dataset_goes_through_tfds(tfds_dir, monkeypatch):
    read = []
    real = loading.classification_arrays
    monkeypatch.setattr(loading, "classification_arrays", lambda *a: read.append(a) or real(*a))
    sliced = _data(tfds_dir, "mpt_digits", train_split="train[:10%]")
    data = load_run_data(sliced, seed=0, shape=None, factory=None)
    assert [split for _, split, _ in read] == ["train[:10%]", "validation"]
    assert (len(data.train[0]), len(data.eval[0])) == (144, 360)
    read.clear()
    load_run_data(_data(tfds_dir, "mpt_digits"), seed=0, shape=None, factory=None)
    assert read == []  # Whole splits: from memory.


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"name": "mnist"},
            "data.name 'mnist': a TFDS dataset. Allowed on Keras' jax backend: data.name "
            "mpt_digits or mpt_python_source (splits train and validation), or a data.factory "
            "returning (x, y[, sample_weight]) arrays; TFDS and tf.data need TensorFlow "
            "(--backend=tensorflow)",
        ),
        (
            {"name": "mpt_digits", "train_split": "train[:10%]"},
            "data.train_split 'train[:10%]': a TFDS split or slice.",
        ),
        (
            {"name": "mpt_digits", "features": {"x": "image", "y": "label"}},
            "data.features {'x': 'image', 'y': 'label'}: a TFDS mapping.",
        ),
    ],
)
def test_what_needs_tfds_is_one_line_on_jax(monkeypatch, options, message):
    from mpt_keras.errors import UserInputError

    monkeypatch.setattr(current, "is_jax", lambda: True)
    with pytest.raises(UserInputError) as raised:
        load_run_data(DataConfig(**options), seed=0, shape=None, factory=None)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)

"""The embedded datasets without TFDS (`embedded_arrays.py`) hold what TFDS stores."""

import numpy as np
import pytest

from mpt_keras.backend import current
from mpt_keras.config import DataConfig
from mpt_keras.data import load_run_data


def _data(tfds_dir, name, **options):
    return DataConfig(name=name, data_dir=tfds_dir, sequence_length=16, **options)


@pytest.mark.parametrize("name", ["mpt_digits", "mpt_python_source"])
def test_a_jax_run_reads_the_arrays_a_tensorflow_run_reads_from_tfds(tfds_dir, monkeypatch, name):
    from_tfds = load_run_data(_data(tfds_dir, name), seed=0, shape=None, factory=None)
    monkeypatch.setattr(current, "is_jax", lambda: True)
    without_tfds = load_run_data(_data(tfds_dir, name), seed=0, shape=None, factory=None)
    assert without_tfds.dimensions == from_tfds.dimensions
    ours_all = (*without_tfds.train, *without_tfds.eval)
    for ours, theirs in zip(ours_all, (*from_tfds.train, *from_tfds.eval), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"name": "mnist"},
            "data.name 'mnist': a TFDS dataset. Allowed on Keras' jax backend: data.name "
            "mpt_digits or mpt_python_source (splits train and validation), or a data.factory "
            "returning (x, y) arrays; TFDS and tf.data need TensorFlow (--backend=tensorflow)",
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

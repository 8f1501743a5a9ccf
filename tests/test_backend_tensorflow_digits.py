"""Tests for the `mpt_digits` TFDS builder."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn import datasets as sklearn_datasets

from mpt_keras.backend.tensorflow import digits  # noqa: F401  (registers mpt_digits)


def _prepare(data_dir) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    builder = tfds.builder("mpt_digits", data_dir=str(data_dir))
    builder.download_and_prepare()
    return {
        split: tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))
        for split in ("train", "validation")
    }


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def sklearn_digits():
    return sklearn_datasets.load_digits()


def _rescaled(counts: np.ndarray) -> np.ndarray:
    # Round half up, independently of the builder's rounding code.
    return np.floor(counts * 255 / 16 + 0.5).astype(np.uint8)[..., np.newaxis]


def test_split_sizes(splits):
    assert len(splits["train"][0]) == 1437
    assert len(splits["train"][1]) == 1437
    assert len(splits["validation"][0]) == 360
    assert len(splits["validation"][1]) == 360


def test_builder_info(tmp_path):
    info = tfds.builder("mpt_digits", data_dir=str(tmp_path)).info
    assert str(info.version) == "1.0.0"
    assert info.supervised_keys == ("image", "label")
    assert info.features["label"].num_classes == 10
    assert "archive.ics.uci.edu" in info.homepage


@pytest.mark.parametrize("split", ["train", "validation"])
def test_shapes_dtypes_and_values(splits, split):
    images, labels = splits[split]
    assert images.shape[1:] == (8, 8, 1)
    assert images.dtype == np.uint8
    assert labels.dtype == np.int64
    assert images.min() == 0
    assert images.max() == 255
    assert set(np.unique(images)) <= set(_rescaled(np.arange(17)).ravel())
    assert set(labels.tolist()) == set(range(10))


def test_first_validation_example_is_sklearn_sample_0(splits, sklearn_digits):
    images, labels = splits["validation"]
    np.testing.assert_array_equal(images[0], _rescaled(sklearn_digits.images[0]))
    assert labels[0] == sklearn_digits.target[0] == 0


def test_splits_follow_index_mod_5_in_sklearn_order(splits, sklearn_digits):
    indices = np.arange(1797)
    validation = indices % 5 == 0
    for split, chosen in (("validation", validation), ("train", ~validation)):
        images, labels = splits[split]
        np.testing.assert_array_equal(images, _rescaled(sklearn_digits.images[chosen]))
        np.testing.assert_array_equal(labels, sklearn_digits.target[chosen])


def test_two_preparations_are_identical(splits, tmp_path):
    again = _prepare(tmp_path)
    for split in ("train", "validation"):
        for first, second in zip(splits[split], again[split]):
            np.testing.assert_array_equal(first, second)

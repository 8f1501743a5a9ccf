"""Tests for `mpt_keras.backend.tensorflow.loading`: offline TFDS loading into numpy arrays."""

import contextlib
import os
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn import datasets as sklearn_datasets

from mpt_keras import data
from mpt_keras.backend.tensorflow import loading
from mpt_keras.embedded_arrays import is_validation, stdlib_dir, stdlib_files
from mpt_keras.errors import UserInputError

_NETWORK_EVENTS = ("socket.connect", "socket.getaddrinfo", "urllib.Request")
_network_calls: list[list[str]] = []


def _audit(event: str, args) -> None:
    if _network_calls and event in _NETWORK_EVENTS:
        _network_calls[-1].append(f"{event} {args!r}")


# Audit hooks cannot be removed; this one only records while `_no_network` runs.
sys.addaudithook(_audit)


@contextlib.contextmanager
def _no_network():
    """Fails if the body tries to reach any network address."""
    calls: list[str] = []
    _network_calls.append(calls)
    try:
        yield
    finally:
        _network_calls.pop()
    assert calls == []


class MptLoadingFixture(tfds.core.GeneratorBasedBuilder):
    """A tiny non-embedded dataset, prepared on disk by the tests."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(2, 2, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=3),
                    "text": tfds.features.Text(),
                }
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for key, (pixel, label, text) in enumerate(
            [(0, 2, "ab"), (51, 0, "cd\u00e9"), (255, 1, "")]
        ):
            image = np.full((2, 2, 1), pixel, dtype=np.uint8)
            yield key, {"image": image, "label": label, "text": text}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """A data_dir where the embedded datasets get prepared once per module."""
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> str:
    """A data_dir holding MptLoadingFixture, prepared on disk."""
    path = str(tmp_path_factory.mktemp("fixture"))
    MptLoadingFixture(data_dir=path).download_and_prepare()
    return path


def test_embedded_datasets_prepare_without_network(data_dir):
    with _no_network():
        for name in data.EMBEDDED_DATASETS:
            assert len(list(loading.load_split(name, "validation", data_dir))) > 0


def test_classification_arrays_digits(data_dir):
    data = loading.classification_arrays("mpt_digits", "validation", data_dir)
    assert data.features.shape == (360, 8, 8, 1)
    assert data.features.dtype == np.float32
    assert data.labels.shape == (360,)
    assert data.labels.dtype == np.int32
    assert data.num_classes == 10
    assert data.features.min() == 0.0
    assert data.features.max() == 1.0
    sklearn_digits = sklearn_datasets.load_digits()
    expected = np.floor(sklearn_digits.images[::5] * 255 / 16 + 0.5) / 255
    np.testing.assert_allclose(data.features[..., 0], expected, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(data.labels, sklearn_digits.target[::5])


def test_classification_data_is_frozen(data_dir):
    data = loading.classification_arrays("mpt_digits", "validation[:3]", data_dir)
    assert data.features.shape == (3, 8, 8, 1)
    with pytest.raises(AttributeError):
        data.num_classes = 3


def test_language_model_windows_python_source(data_dir):
    inputs, targets = loading.language_model_windows(
        "mpt_python_source", "validation", data_dir, sequence_length=64
    )
    texts = []
    for name in stdlib_files():
        if is_validation(name):
            with open(os.path.join(stdlib_dir(), name), "rb") as source:
                texts.append(source.read())
    stream = np.frombuffer(b"\n".join(texts), dtype=np.uint8).astype(np.int32)
    num_windows = len(stream) // 65
    windows = stream[: num_windows * 65].reshape(num_windows, 65)
    assert inputs.shape == targets.shape == (num_windows, 64)
    assert inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs, windows[:, :-1])
    np.testing.assert_array_equal(targets, windows[:, 1:])
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])
    assert 0 <= inputs.min() and inputs.max() < data.VOCAB_SIZE


def test_unknown_dataset_name():
    with pytest.raises(UserInputError) as raised:
        loading.load_split("foo", "train", None)
    assert str(raised.value) == (
        "Unknown dataset 'foo': not a TFDS dataset. Allowed: mpt_digits, "
        "mpt_python_source, or any name in tfds.list_builders()."
    )


def test_community_dataset_is_refused_without_network():
    with _no_network(), pytest.raises(UserInputError, match="need network access"):
        loading.load_split("kubric:movi_a", "train", None)


def test_unknown_split(data_dir):
    with pytest.raises(UserInputError) as raised:
        loading.load_split("mpt_digits", "test", data_dir)
    assert str(raised.value) == (
        "Unknown split 'test' for dataset 'mpt_digits'. Allowed: train, "
        "validation, or a TFDS slice of them such as 'train[:10%]'."
    )


def test_empty_split(data_dir):
    with pytest.raises(UserInputError, match="has no examples"):
        loading.classification_arrays("mpt_digits", "train[:0]", data_dir)


def test_known_but_unprepared_dataset_fails_without_trying_the_network(tmp_path):
    # _no_network fails the test if anything tried to connect.
    with _no_network(), pytest.raises(UserInputError) as raised:
        loading.classification_arrays("mnist", "train", str(tmp_path))
    assert str(raised.value) == (
        f"Dataset 'mnist' is not prepared in {tmp_path} and cannot be downloaded "
        f"here: run `tfds build mnist --data_dir={tmp_path}` on a machine with "
        "network access and copy the directory here, or point data_dir (config "
        "key data.data_dir) at a directory where it is prepared."
    )
    assert not (tmp_path / "mnist").exists()


def test_non_embedded_dataset_loads_from_disk(fixture_dir):
    examples = list(tfds.as_numpy(loading.load_split("mpt_loading_fixture", "train", fixture_dir)))
    assert [example["label"] for example in examples] == [2, 0, 1]
    assert [example["text"] for example in examples] == [b"ab", "cd\u00e9".encode(), b""]


def test_non_embedded_classification_arrays(fixture_dir):
    data = loading.classification_arrays("mpt_loading_fixture", "train", fixture_dir)
    assert data.num_classes == 3
    assert data.features.dtype == np.float32
    np.testing.assert_allclose(data.features[:, 0, 0, 0], [0.0, 0.2, 1.0], rtol=0, atol=1e-7)
    assert data.features.shape == (3, 2, 2, 1)
    np.testing.assert_array_equal(data.labels, np.array([2, 0, 1], dtype=np.int32))


def test_non_embedded_language_model_windows(fixture_dir):
    # Stream b"ab\ncd\xc3\xa9\n" has 8 bytes: 2 windows of 3, 2 bytes left over.
    inputs, targets = loading.language_model_windows(
        "mpt_loading_fixture", "train", fixture_dir, sequence_length=2
    )
    np.testing.assert_array_equal(inputs, [[97, 98], [99, 100]])
    np.testing.assert_array_equal(targets, [[98, 10], [100, 0xC3]])
    assert inputs.dtype == targets.dtype == np.int32


def test_unprepared_non_embedded_dataset(tmp_path):
    with pytest.raises(UserInputError, match="is not prepared in"):
        loading.load_split("mpt_loading_fixture", "train", str(tmp_path))


def test_wrong_features_are_refused(data_dir):
    with pytest.raises(UserInputError, match="not an image classification dataset"):
        loading.classification_arrays("mpt_python_source", "validation", data_dir)
    with pytest.raises(UserInputError, match="has no text to model"):
        loading.language_model_windows("mpt_digits", "validation", data_dir, 8)


def test_too_long_sequence_is_refused(fixture_dir):
    with pytest.raises(UserInputError, match="fewer than one window"):
        loading.language_model_windows("mpt_loading_fixture", "train", fixture_dir, 8)
    with pytest.raises(
        UserInputError, match="sequence_length: received 0. Allowed: an integer >= 1"
    ):
        loading.language_model_windows("mpt_loading_fixture", "train", fixture_dir, 0)


def test_a_first_preparation_prints_nothing_before_an_error(tmp_path, capsys):
    # On a fresh data_dir a bad split prepares the dataset first: TFDS' two lines of it would
    # precede the error, which must be the one line a launcher prints.
    with pytest.raises(UserInputError, match="^Unknown split 'bogus' for dataset 'mpt_digits'"):
        loading.load_split("mpt_digits", "bogus", str(tmp_path))
    assert capsys.readouterr() == ("", "")

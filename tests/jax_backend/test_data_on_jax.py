"""A run's data on Keras' JAX backend with TensorFlow blocked: the embedded datasets as arrays."""

import sys

import numpy as np

from examples.user_data import digits_rgb
from mpt_keras.config import DataConfig
from mpt_keras.data import array_batches, load_run_data


def test_the_embedded_digits_load_and_batch_without_tensorflow():
    data = load_run_data(DataConfig(name="mpt_digits"), seed=0, shape=None, factory=None)
    (train_x, train_y), (eval_x, _) = data.train, data.eval
    assert (train_x.shape, eval_x.shape, train_y.dtype) == (
        (1437, 8, 8, 1),
        (360, 8, 8, 1),
        np.int32,
    )
    assert dict(data.dimensions) == {"input_shape": (8, 8, 1), "num_classes": 10}
    x, y = next(data.train_batches(32, seed=3, start_step=5))
    expected = array_batches.batch_of_step(train_x, train_y, 32, seed=3, step=5)
    np.testing.assert_array_equal(y, expected[1])
    np.testing.assert_array_equal(data.batch_of_step(32, seed=3, step=6)[0], x)
    assert sum(len(y) for _, y in data.eval_batches(100)) == 360
    assert "tensorflow" not in sys.modules


def test_the_embedded_python_source_windows_without_tensorflow():
    source = DataConfig(name="mpt_python_source", sequence_length=32)
    data = load_run_data(source, seed=0, shape=None, factory=None)
    inputs, targets = data.train
    assert inputs.shape[1] == 32 and inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # Next-token targets.
    assert dict(data.dimensions) == {"vocab_size": 256, "sequence_length": 32}
    assert "tensorflow" not in sys.modules


def test_the_keras_applications_examples_digits_are_arrays_without_tensorflow():
    """examples/configs/mobilenet_digits.json's data factory, as a user's runs on JAX."""
    (train_x, train_y), (eval_x, _), dimensions = digits_rgb(image_size=16)
    assert (train_x.shape, eval_x.shape, train_x.dtype, train_y.shape) == (
        (1438, 16, 16, 3),
        (359, 16, 16, 3),
        np.float32,
        (1438,),
    )
    np.testing.assert_array_equal(train_x[..., 0], train_x[..., 2])  # Grey, in 3 channels.
    assert dimensions == {"num_classes": 10}
    assert "tensorflow" not in sys.modules

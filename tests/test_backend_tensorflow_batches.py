"""Tests for `mpt_keras.backend.tensorflow.batches`: deterministic, resumable batching."""

import numpy as np
import pytest
import tensorflow as tf

from mpt_keras.backend.tensorflow.batches import eval_batches, train_batches
from mpt_keras.errors import UserInputError

N = 10
BATCH = 4


def _arrays(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """Features [n, 2] float32 whose first column is the label (the index)."""
    labels = np.arange(n, dtype=np.int32)
    features = np.stack([labels, -labels], axis=1).astype(np.float32)
    return features, labels


def _take(dataset: tf.data.Dataset, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(dataset.take(count).as_numpy_iterator())


def _order(batches) -> np.ndarray:
    """Labels of consecutive positions, which equal the example indices."""
    return np.concatenate([labels for _, labels in batches])


def test_batches_have_fixed_shape_and_keep_dtypes():
    features, labels = _arrays()
    dataset = train_batches(features, labels, BATCH, seed=7)
    assert dataset.element_spec[0].shape == (BATCH, 2)
    assert dataset.element_spec[1].shape == (BATCH,)
    for x, y in _take(dataset, 6):
        assert x.dtype == np.float32 and y.dtype == np.int32
        np.testing.assert_array_equal(x[:, 0], y)
        np.testing.assert_array_equal(x[:, 1], -y)


def test_is_deterministic():
    features, labels = _arrays()
    first = _order(_take(train_batches(features, labels, BATCH, seed=7), 12))
    second = _order(_take(train_batches(features, labels, BATCH, seed=7), 12))
    np.testing.assert_array_equal(first, second)


def test_order_is_index_shuffle_of_position_with_epoch_seed():
    features, labels = _arrays()
    order = _order(_take(train_batches(features, labels, BATCH, seed=7), 8))
    expected = [
        int(tf.random.experimental.index_shuffle(p % N, seed=[7, p // N], max_index=N - 1))
        for p in range(8 * BATCH)
    ]
    np.testing.assert_array_equal(order, expected)


def test_each_data_epoch_is_a_fresh_permutation():
    features, labels = _arrays()
    order = _order(_take(train_batches(features, labels, BATCH, seed=7), 10))
    epochs = order.reshape(4, N)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(N))
    assert len({tuple(epoch) for epoch in epochs}) == 4


@pytest.mark.parametrize("start_step", [1, 2, 3, 5, 7])
def test_start_step_resumes_at_the_exact_position(start_step):
    # With N=10 and batch 4, batches 2 and 7 straddle data epochs.
    features, labels = _arrays()
    full = _take(train_batches(features, labels, BATCH, seed=3), start_step + 6)
    resumed = _take(train_batches(features, labels, BATCH, seed=3, start_step=start_step), 6)
    for (x_full, y_full), (x_resumed, y_resumed) in zip(full[start_step:], resumed):
        np.testing.assert_array_equal(x_full, x_resumed)
        np.testing.assert_array_equal(y_full, y_resumed)


def test_batch_larger_than_dataset_spans_several_epochs():
    features, labels = _arrays(3)
    order = _order(_take(train_batches(features, labels, 7, seed=1), 3))
    for epoch in order.reshape(7, 3):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(3))
    resumed = _order(_take(train_batches(features, labels, 7, seed=1, start_step=2), 1))
    np.testing.assert_array_equal(resumed, order[14:])


def test_different_seeds_differ():
    features, labels = _arrays()
    first = _order(_take(train_batches(features, labels, BATCH, seed=1), 5))
    second = _order(_take(train_batches(features, labels, BATCH, seed=2), 5))
    assert not np.array_equal(first, second)


def test_stream_is_infinite():
    features, labels = _arrays()
    dataset = train_batches(features, labels, BATCH, seed=0)
    assert dataset.cardinality() == tf.data.INFINITE_CARDINALITY


@pytest.mark.parametrize(
    ("arrays", "batch_size", "start_step", "message"),
    [
        (_arrays(), 0, 0, "batch_size: received 0. Allowed: an integer >= 1"),
        (_arrays(0), 4, 0, "0 examples"),
        ((_arrays()[0], _arrays(9)[1]), 4, 0, "10 examples but 9 labels"),
        (_arrays(), 4, -1, "start_step: received -1. Allowed: an integer >= 0"),
    ],
)
def test_train_batches_refuses_bad_input(arrays, batch_size, start_step, message):
    with pytest.raises(UserInputError, match=message):
        train_batches(*arrays, batch_size, seed=0, start_step=start_step)


def test_eval_batches_keep_order_and_last_partial_batch():
    tokens = np.arange(30, dtype=np.int32).reshape(N, 3)
    labels = np.arange(N, dtype=np.int32) + 100
    batches = list(eval_batches(tokens, labels, BATCH).as_numpy_iterator())
    assert [len(y) for _, y in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), tokens)
    np.testing.assert_array_equal(np.concatenate([y for _, y in batches]), labels)
    assert batches[0][0].dtype == np.int32


def test_a_dict_of_inputs_is_batched_row_for_row_in_the_arrays_order():
    features, labels = _arrays()
    inputs = {"token_ids": labels * 10, "padding_mask": labels > 0}
    as_arrays = _take(train_batches(features, labels, BATCH, seed=7, start_step=1), 4)
    as_dict = _take(train_batches(inputs, labels, BATCH, seed=7, start_step=1), 4)
    for (_, expected), (x, y) in zip(as_arrays, as_dict, strict=True):
        np.testing.assert_array_equal(y, expected)
        np.testing.assert_array_equal(x["token_ids"], expected * 10)
        np.testing.assert_array_equal(x["padding_mask"], expected > 0)
    last = list(eval_batches(inputs, labels, BATCH).as_numpy_iterator())[-1]
    assert last[0]["token_ids"].tolist() == [80, 90]


def test_a_dict_of_labels_one_per_output_is_batched_row_for_row():
    features, labels = _arrays()
    outputs = {"digit": labels, "parity": labels % 2}
    for x, y in _take(train_batches(features, outputs, BATCH, seed=7, start_step=1), 4):
        np.testing.assert_array_equal(y["digit"], x[:, 0])
        np.testing.assert_array_equal(y["parity"], y["digit"] % 2)
    last = list(eval_batches(features, outputs, BATCH).as_numpy_iterator())[-1]
    assert {name: array.tolist() for name, array in last[1].items()} == {
        "digit": [8, 9],
        "parity": [0, 1],
    }
    with pytest.raises(UserInputError, match="Got 10 examples but 9 labels"):
        train_batches(features, {"digit": labels[:9]}, BATCH, seed=0)


def test_eval_batches_refuses_bad_input():
    with pytest.raises(UserInputError, match="batch_size: received 0. Allowed: an integer >= 1"):
        eval_batches(*_arrays(), 0)
    with pytest.raises(UserInputError, match="0 examples"):
        eval_batches(*_arrays(0), 4)


def test_both_pipelines_run_without_tf_datas_autotuning():
    # Its thread costs CPU and a deleted iterator waits for it (batches.py's docstring).
    for batches in (train_batches(*_arrays(), BATCH, seed=0), eval_batches(*_arrays(), BATCH)):
        assert batches.options().autotune.enabled is False

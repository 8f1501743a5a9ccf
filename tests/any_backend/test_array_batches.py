"""The NumPy batching a JAX run trains on (`data/array_batches.py`), on either backend."""

import numpy as np
import pytest

from mpt_keras.data import array_batches
from mpt_keras.errors import UserInputError

FEATURES = np.arange(10, dtype=np.float32).reshape(10, 1) * 10
LABELS = np.arange(10, dtype=np.int32)


def _labels(batches, count):
    return [next(batches)[1].tolist() for _ in range(count)]


def test_each_data_epoch_is_a_seeded_permutation_and_batches_straddle_epochs():
    stream = _labels(array_batches.train_batches(FEATURES, LABELS, 4, seed=7), 5)
    flat = [label for batch in stream for label in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # A fresh order each data epoch.
    # The order is NumPy's permutation seeded by (seed, epoch).
    assert flat[:10] == np.random.default_rng([7, 0]).permutation(10).tolist()
    assert flat[10:20] == np.random.default_rng([7, 1]).permutation(10).tolist()
    assert _labels(array_batches.train_batches(FEATURES, LABELS, 4, seed=7), 5) == stream
    assert _labels(array_batches.train_batches(FEATURES, LABELS, 4, seed=8), 5) != stream


@pytest.mark.parametrize("start_step", [1, 2, 3, 7])
def test_a_resumed_stream_continues_at_the_exact_batch(start_step):
    whole = _labels(array_batches.train_batches(FEATURES, LABELS, 3, seed=0), 12)
    resumed = array_batches.train_batches(FEATURES, LABELS, 3, seed=0, start_step=start_step)
    assert _labels(resumed, 12 - start_step) == whole[start_step:]
    x, y = array_batches.batch_of_step(FEATURES, LABELS, 3, seed=0, step=start_step)
    assert y.tolist() == whole[start_step]
    np.testing.assert_array_equal(x[:, 0], y * 10.0)  # Features stay with their labels.
    assert (x.dtype, y.dtype) == (np.float32, np.int32)


def test_eval_batches_pass_once_in_order_keeping_the_partial_last_batch():
    batches = array_batches.eval_batches(FEATURES, LABELS, 4)
    assert [y.tolist() for _, y in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(batches) == 3 and [y.tolist() for _, y in batches][-1] == [8, 9]


@pytest.mark.parametrize(
    "features, labels, batch_size, message",
    [
        (FEATURES, LABELS, 0, "batch_size: received 0. Allowed: an integer >= 1"),
        (FEATURES[:0], LABELS[:0], 2, "The dataset has 0 examples. Allowed: at least 1 example."),
        (FEATURES, LABELS[:9], 2, "Got 10 examples but 9 labels. Allowed: one label per example."),
    ],
)
def test_bad_batching_is_one_line(features, labels, batch_size, message):
    with pytest.raises(UserInputError) as raised:
        next(array_batches.train_batches(features, labels, batch_size, seed=0))
    assert str(raised.value) == message


# A dict of inputs (a keras_hub backbone's): each input batched at the same rows, in the
# order the same data as one array gets.
INPUTS = {"token_ids": FEATURES[:, 0].astype(np.int32), "padding_mask": FEATURES > 0}


def test_a_dict_of_inputs_is_batched_row_for_row_in_the_arrays_order():
    stream = array_batches.train_batches(INPUTS, LABELS, 4, seed=7, start_step=2)
    whole = _labels(array_batches.train_batches(FEATURES, LABELS, 4, seed=7), 5)
    for expected in whole[2:]:
        x, y = next(stream)
        assert y.tolist() == expected
        assert x["token_ids"].tolist() == [10 * label for label in expected]
        assert x["padding_mask"][:, 0].tolist() == [label > 0 for label in expected]
    batches = array_batches.eval_batches(INPUTS, LABELS, 4)
    assert len(batches) == 3 and batches[2][0]["token_ids"].tolist() == [80, 90]


def test_a_dict_of_labels_one_per_output_is_batched_row_for_row():
    outputs = {"digit": LABELS, "parity": LABELS % 2}
    x, y = array_batches.batch_of_step(FEATURES, outputs, 4, seed=7, step=2)
    np.testing.assert_array_equal(y["digit"] * 10.0, x[:, 0])
    np.testing.assert_array_equal(y["parity"], y["digit"] % 2)
    batches = array_batches.eval_batches(FEATURES, outputs, 4)
    assert [batch[1]["parity"].tolist() for batch in batches] == [[0, 1, 0, 1]] * 2 + [[0, 1]]
    with pytest.raises(UserInputError) as raised:
        next(array_batches.train_batches(FEATURES, {"digit": LABELS[:9]}, 4, seed=0))
    assert str(raised.value) == "Got 10 examples but 9 labels. Allowed: one label per example."


def test_sample_weights_are_batched_row_for_row_as_a_third_element():
    weights = LABELS.astype(np.float32) / 10
    x, y, w = array_batches.batch_of_step(
        FEATURES, LABELS, 4, seed=7, step=2, sample_weight=weights
    )
    np.testing.assert_array_equal(w * 10, y)
    assert (
        next(array_batches.train_batches(FEATURES, LABELS, 4, seed=7))[1].tolist()
        == (
            next(array_batches.train_batches(FEATURES, LABELS, 4, seed=7, sample_weight=weights))[1]
        ).tolist()
    )  # The same order with weights or without.
    batches = array_batches.eval_batches(FEATURES, LABELS, 4, sample_weight=weights)
    assert [batch[2].tolist() for batch in batches][-1] == weights[8:].tolist()
    with pytest.raises(UserInputError) as raised:
        next(array_batches.train_batches(FEATURES, LABELS, 4, seed=0, sample_weight=weights[:9]))
    assert str(raised.value) == (
        "Got 10 examples but 9 sample weights. Allowed: one sample weight per example."
    )


def test_a_run_trains_on_the_sample_weights_of_its_data_factorys_arrays(tmp_path, monkeypatch):
    """Weights of 0 make every train loss 0; of 1, the loss as without weights."""
    from tiny_runs import tiny_config

    import mpt_keras

    (tmp_path / "weighted_data.py").write_text(
        "from examples.user_data import digits_arrays\n"
        "def load(weight, seed=0):\n"
        "    (x, y), evaluation, dimensions = digits_arrays(seed)\n"
        "    return (x, y, weight * (y >= 0).astype('float32')), evaluation, dimensions\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    losses = {}
    for weight in (0.0, 1.0, None):
        data = {"name": None, "factory": "weighted_data:load", "options": {"weight": weight}}
        if weight is None:
            data = {"name": None, "factory": "examples.user_data:digits_arrays"}
        run = tmp_path / f"run_{weight}"
        mpt_keras.run_training(tiny_config(None, data=data), mpt_keras.Runtime(str(run), verbose=0))
        rows = (run / "metrics.csv").read_text().splitlines()
        column = rows[0].split(",").index("loss")
        cells = [row.split(",")[column] for row in rows[1:]]
        losses[weight] = [float(cell) for cell in cells if cell]  # Not the evaluation's rows.
    assert losses[0.0] == [0.0, 0.0, 0.0]
    assert losses[1.0] == losses[None] and min(losses[None]) > 0


def test_labels_by_position_are_batched_row_for_row_as_a_tuple():
    from mpt_keras.data import checked_split

    x, y = checked_split((FEATURES, [LABELS, LABELS % 2]), "data[0]", "data.batch_size: 4")
    assert isinstance(y, tuple) and len(y) == 2  # tf.data would stack a list into one tensor.
    batch_x, (digit, parity) = array_batches.batch_of_step(x, y, 4, seed=7, step=2)
    np.testing.assert_array_equal(digit * 10.0, batch_x[:, 0])
    np.testing.assert_array_equal(parity, digit % 2)
    _, labels = checked_split((FEATURES, list(LABELS)), "data[0]", "data.batch_size: 4")
    assert labels.tolist() == LABELS.tolist()  # A list of numbers: the rows of one array.


def test_a_run_trains_on_labels_by_position_as_on_labels_by_name(tmp_path, monkeypatch):
    from tiny_runs import tiny_config

    import mpt_keras

    (tmp_path / "two_outputs.py").write_text(
        "import keras\n"
        "from examples.user_data import digits_arrays\n"
        "def model():\n"
        "    x = keras.Input((8, 8, 1))\n"
        "    hidden = keras.layers.Dense(16, activation='relu')(keras.layers.Flatten()(x))\n"
        "    outputs = [keras.layers.Dense(10, name='digit')(hidden),\n"
        "               keras.layers.Dense(1, name='parity')(hidden)]\n"
        "    return keras.Model(x, outputs)\n"
        "def losses():\n"
        "    return [keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
        "            keras.losses.BinaryCrossentropy(from_logits=True)]\n"
        "def data(by, seed=0):\n"
        "    def labels(y):\n"
        "        parity = (y % 2).astype('float32')[:, None]\n"
        "        return [y, parity] if by == 'position' else {'digit': y, 'parity': parity}\n"
        "    (x, y), (ex, ey), dimensions = digits_arrays(seed)\n"
        "    return (x, labels(y)), (ex, labels(ey)), dimensions\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = {}
    for by in ("position", "name"):
        config = tiny_config(
            None,
            model={"name": None, "factory": "two_outputs:model"},
            data={"name": None, "factory": "two_outputs:data", "options": {"by": by}},
            loss={"factory": "two_outputs:losses"},
            metrics=["accuracy"],
        )
        run = mpt_keras.Runtime(str(tmp_path / by), verbose=0)
        metrics[by] = mpt_keras.run_training(config, run)
    assert metrics["position"] == metrics["name"]
    assert {"val_digit_accuracy", "val_parity_accuracy"} <= set(metrics["name"])


@pytest.mark.parametrize(
    "split, message",
    [
        (
            ({"token_ids": np.ones((4, 2)), "padding_mask": np.ones((3, 2))}, np.ones(4)),
            "data[0]: received arrays of lengths x['token_ids'] 4, x['padding_mask'] 3, y 4. "
            "Allowed: one length, the number of examples, along the first axis of each",
        ),
        (
            ({}, np.ones(4)),
            "data[0]: x: received a dict with keys []. Allowed: a non-empty dict of arrays "
            "keyed by the model's input names",
        ),
        (
            (np.ones(3), {"digit": np.ones(3), "parity": np.ones(2)}),
            "data[0]: received arrays of lengths x 3, y['digit'] 3, y['parity'] 2. Allowed: "
            "one length, the number of examples, along the first axis of each",
        ),
        (
            (np.ones(3), {1: np.ones(3)}),
            "data[0]: y: received a dict with keys [1]. Allowed: a non-empty dict of arrays "
            "keyed by the model's output names",
        ),
        (
            (np.ones(3), np.float32(1)),
            "data[0]: y: received a scalar. Allowed: an array whose first axis counts the examples",
        ),
        (
            (np.ones(3), np.ones(3), np.ones(2)),
            "data[0]: received arrays of lengths x 3, y 3, sample_weight 2. Allowed: one "
            "length, the number of examples, along the first axis of each",
        ),
        (
            (np.ones(3), {"digit": np.ones(3)}, {"parity": np.ones(3)}),
            "data[0]: sample_weight: received a dict with keys ['parity']. Allowed: one array "
            "for every output, or a dict with the keys of y: ['digit']",
        ),
        (
            (np.ones(3), np.ones(3), {"digit": np.ones(3)}),
            "data[0]: sample_weight: received a dict with keys ['digit']. Allowed: one array "
            "for every output, or a dict with the keys of y",
        ),
        (
            (np.ones(3), [np.ones(3), np.ones(3)], [np.ones(3)]),
            "data[0]: sample_weight: received a list of 1 arrays. Allowed: one array for every "
            "output, or as y is, a list of 2",
        ),
        (
            (np.ones(3), [np.ones(2)] * 8),
            "data[0]: received arrays of lengths x 3, y[0] 2, y[1] 2, y[2] 2, y[3] 2, y[4] 2, "
            "... (3 more). Allowed: one length, the number of examples, along the first axis "
            "of each",
        ),
        (
            (np.ones(3), np.ones(3), np.ones(3), np.ones(3)),
            "data[0]: received a tuple of 4. Allowed: {dataset}a tuple (x, y) or (x, y, "
            "sample_weight) of arrays of one length, each an array, a dict of them by name or "
            "a list by position",
        ),
    ],
)
def test_in_memory_data_a_run_cannot_take_is_one_line(split, message):
    import keras

    from mpt_keras.data import checked_split

    with pytest.raises(UserInputError) as raised:
        checked_split(split, "data[0]", "data.batch_size: 4")
    dataset = (
        "" if keras.backend.backend() == "jax" else "a tf.data.Dataset of unbatched elements, or "
    )
    assert str(raised.value) == message.format(dataset=dataset)


def test_arrays_with_sample_weights_are_taken_as_three():
    from mpt_keras.data import checked_split

    x, y, w = checked_split(
        ([[1.0], [2.0]], {"digit": [0, 1]}, {"digit": [0.5, 2.0]}), "data[0]", "data.batch_size: 4"
    )
    assert (x.shape, y["digit"].tolist(), w["digit"].tolist()) == ((2, 1), [0, 1], [0.5, 2.0])
    _, _, w = checked_split(([[1.0], [2.0]], {"digit": [0, 1]}, [0.5, 2.0]), "data[0]", "")
    assert w.tolist() == [0.5, 2.0]  # One array: every output's.

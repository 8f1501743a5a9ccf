"""Tests of mpt_keras.runs.canary: a short run that stops a diverging precision."""

import json
import os

import pytest

import mpt_keras
from mpt_keras.runs import canary
from mpt_keras.runs.canary import CanaryThresholds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEPS = 10


def _config(tfds_dir, learning_rate=0.002, precision="mixed_float16"):
    config = mpt_keras.TrainConfig.from_json(os.path.join(REPO, "configs", "digits_mlp.json"))
    return config.merged(
        {
            "precision": precision,
            "data": {"data_dir": tfds_dir},
            "optimizer": {"learning_rate": learning_rate},
        }
    )


def test_a_healthy_run_goes_through(tfds_dir):
    result = canary.run_canary(_config(tfds_dir), _STEPS)
    assert not result.diverged, result.message
    assert result.message.startswith(
        "canary of mixed_float16 over 10 steps: healthy: the loss went from "
    )
    assert (len(result.losses), len(result.baseline_losses)) == (_STEPS, _STEPS)
    assert result.skipped_steps == 0


def test_a_huge_learning_rate_is_stopped_as_rising(tfds_dir):
    result = canary.run_canary(_config(tfds_dir, learning_rate=50.0), _STEPS)
    assert result.diverged
    assert result.message.startswith(
        "canary of mixed_float16 over 10 steps: diverged: the loss rose"
    )
    assert result.message.endswith("(allowed: at most 10% above the first step's)")


def test_a_non_finite_loss_is_stopped_naming_the_step(tfds_dir):
    result = canary.run_canary(_config(tfds_dir, learning_rate=1e6), _STEPS)
    assert result.diverged
    assert (
        result.message
        == "canary of mixed_float16 over 10 steps: diverged: the loss is nan at step 3"
    )
    values = json.loads(json.dumps(result.to_dict()))
    assert values["losses"][2] == "nan"
    assert values["diverged"] is True


def test_float32_matches_itself_even_with_no_gap_allowed(tfds_dir):
    result = canary.run_canary(
        _config(tfds_dir, precision="float32"),
        3,
        CanaryThresholds(max_loss_gap=0.0, max_loss_rise=1.0),
    )
    assert result.losses == result.baseline_losses
    assert not result.diverged, result.message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_loss_rise": -0.1}, "canary max_loss_rise: received -0.1. Allowed: a number >= 0"),
        ({"max_loss_gap": None}, "canary max_loss_gap: received None. Allowed: a number >= 0"),
        ({"examples": 0}, "canary examples: received 0. Allowed: an integer >= 1"),
    ],
)
def test_bad_thresholds_are_user_errors(kwargs, message):
    with pytest.raises(mpt_keras.UserInputError) as error:
        CanaryThresholds(**kwargs)
    assert str(error.value) == message


def test_bad_steps_are_a_user_error(tfds_dir):
    with pytest.raises(mpt_keras.UserInputError) as error:
        canary.run_canary(_config(tfds_dir), 0)
    assert str(error.value) == "canary steps: received 0. Allowed: an integer >= 1"


@pytest.mark.parametrize(
    "losses, baseline_losses, diverged, verdict",
    [
        ((2.0, 1.0), (2.0, 1.0), False, "healthy: the loss went from 2 to 1 (float32: 1)"),
        ((2.0, 1.25), (2.0, 1.0), False, "healthy: the loss went from 2 to 1.25 (float32: 1)"),
        (
            (2.0, 1.3),
            (2.0, 1.0),
            True,
            "diverged: the loss is 1.3 against float32's 1 (allowed: at most 25% above)",
        ),
        (
            (2.0, 2.3),
            (2.0, 2.3),
            True,
            "diverged: the loss rose from 2 to 2.3 (allowed: at most 10% above the first step's)",
        ),
        ((2.0, float("inf")), (2.0, 1.0), True, "diverged: the loss is inf at step 2"),
    ],
)
def test_verdicts_pin_each_rule(losses, baseline_losses, diverged, verdict):
    assert canary._verdict(losses, baseline_losses, CanaryThresholds()) == (diverged, verdict)


def test_a_subclassed_model_of_ones_own_runs_the_canary_without_a_config():
    import keras
    import numpy as np

    class TwoLayers(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.logits = keras.layers.Dense(3)

        def call(self, inputs):
            return self.logits(self.hidden(inputs))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")
    settings = mpt_keras.TrainConfig.from_dict(
        {"precision": "mixed_float16", "data": {"batch_size": 32}}
    )
    result = canary.run_canary(
        TwoLayers,
        _STEPS,
        data=((x, y), (x[:64], y[:64])),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        config=settings,
    )
    assert result.precision == "mixed_float16"
    assert len(result.losses) == len(result.baseline_losses) == _STEPS
    assert not result.diverged, result.message
    # Not float32's trajectory: the candidate computed in float16.
    assert result.losses != result.baseline_losses

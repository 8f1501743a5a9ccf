"""The benchmarks' stacks: stock Keras, and each piece of ours as documented."""

import keras
import pytest

from benchmarks import harness, stacks
from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.precision.policies import global_policy
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry.monitor import MixedPrecisionMonitor


def _compiled(precision: str, pieces, tmp_path) -> tuple[keras.Model, list]:
    with global_policy(precision):
        model = harness.reference_model("mlp", 8, 1, 8)
        callbacks = stacks.compile_stack(
            model, precision, False, pieces, str(tmp_path), 64, loss=models.REFERENCE_LOSS
        )
    return model, callbacks


@pytest.mark.parametrize(
    ("precision", "optimizer_type", "scale"),
    [
        ("float32", keras.optimizers.AdamW, None),
        ("mixed_float16", keras.optimizers.LossScaleOptimizer, 2.0**15),
    ],
)
def test_stock_is_keras_alone(tmp_path, precision, optimizer_type, scale):
    model, callbacks = _compiled(precision, (), tmp_path)
    assert type(model.optimizer) is optimizer_type
    assert getattr(model.optimizer, "initial_scale", None) == scale
    assert "train_step" not in vars(model)
    assert callbacks == []
    assert model.loss is models.REFERENCE_LOSS
    # No safe defaults: the output layer computes in the global policy.
    assert model.layers[-1].dtype_policy.name == precision


@pytest.mark.parametrize(
    ("precision", "dynamic", "scale"),
    [("mixed_bfloat16", False, 1.0), ("mixed_float16", True, 2.0**15)],
)
def test_ours_has_every_piece(tmp_path, precision, dynamic, scale):
    model, callbacks = _compiled(precision, stacks.PIECES, tmp_path)
    optimizer = model.optimizer
    assert isinstance(optimizer, LossScaleOptimizer)
    assert (optimizer.dynamic, optimizer.loss_scale) == (dynamic, scale)
    assert vars(model)["train_step"].__qualname__.startswith("_replica_train_step")
    assert model.layers[-1].dtype_policy.name == "float32"
    assert [type(callback) for callback in callbacks] == [MixedPrecisionMonitor]


def test_an_unknown_piece_is_named(tmp_path):
    with pytest.raises(UserInputError) as error:
        _compiled("float32", ("monitor", "ema"), tmp_path)
    assert str(error.value) == (
        "pieces: received 'ema'. Allowed: train_step, loss_scale_optimizer, manifest, monitor"
    )


@pytest.mark.parametrize("pieces", [(), stacks.PIECES])
def test_every_stack_trains_with_the_loss_it_is_given(tmp_path, pieces):
    with global_policy("float32"):
        model = harness.reference_model("mlp", 8, 1, 8)
        stacks.compile_stack(
            model, "float32", False, pieces, str(tmp_path), 4, loss="mean_squared_error"
        )
    assert model.loss == "mean_squared_error"

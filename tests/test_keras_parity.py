"""Keras 3.15.1's own tests of the stock loss-scale optimizer, restated for ours.

`mpt_keras.LossScaleOptimizer` is a drop-in for `keras.optimizers.LossScaleOptimizer`,
so what Keras tests of the stock class should hold for ours. This file restates,
in our own words and data, the tests users of the stock class rely on:

- `keras/src/optimizers/loss_scale_optimizer_test.py` (the stateful cases; the
  TF backend has no `stateless_apply`);
- `keras/src/optimizers/multi_optimizer_test.py`, the cases that make sense with
  a `MultiOptimizer` inside ours (the ones that test `OptimizerMap` matching
  alone, or `stateless_apply`, do not involve a loss-scale optimizer);
- `keras/src/optimizers/optimizer_sparse_test.py`, each optimizer it
  parametrizes wrapped in ours;
- `keras/src/callbacks/swap_ema_weights_test.py`;
- `integration_tests/tf_distribute_training_test.py` of the keras-team/keras
  repository (not in the wheel).

Each test names the Keras test it mirrors. Where ours differs on purpose (the
class docstring and docs/loss_scaling.md, "Why ours differs"), the test asserts
our documented behaviour and says so. A behaviour the stock class has and ours
lacks without a documented reason would be an `xfail(strict=True)` naming it;
there is none now.

The two tf.distribute cases need the CPU split into two logical devices before
TensorFlow initializes its devices, so they run in the two-CPU host, a child process
that imports this module and calls `_distributed_results` (`replicas.run_on_two_cpus`).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from replicas import on_two_cpus, run_on_two_cpus, two_cpu_strategy

from mpt_keras.scaling.optimizer import LossScaleOptimizer

# Its two-replica cases run in the two-CPU host (tests/replicas.py).
pytestmark = on_two_cpus

_TESTS_DIR = Path(__file__).resolve().parent

# Keras' gradient, used throughout its loss-scale optimizer tests.
GRAD = [1.0, 6.0, 7.0, 2.0]
MODES = ["eager", "function", "jit"]


def _weights() -> keras.Variable:
    return keras.Variable([1.0, 2.0, 3.0, 4.0], name="w")


def _applier(opt: Any, variables: list[keras.Variable], mode: str) -> Callable[..., None]:
    """`opt.apply(grads, variables)` in the given execution mode, one gradient per variable."""

    def apply(grads: list[tf.Tensor]) -> None:
        opt.apply(grads, variables)

    if mode != "eager":
        apply = tf.function(apply, jit_compile=mode == "jit")
    return lambda *grads: apply([tf.constant(g, tf.float32) for g in grads])


# --- keras/src/optimizers/loss_scale_optimizer_test.py ----------------------


def test_config_round_trips_through_json_and_keras_serialization():
    """Keras: loss_scale_optimizer_test.py::test_config (run_class_serialization_test)."""
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.25, momentum=0.1, nesterov=True, weight_decay=0.01)
    )
    config = opt.get_config()
    revived = LossScaleOptimizer.from_config(json.loads(json.dumps(config)))
    assert revived.get_config() == config
    assert set(dir(revived)) == set(dir(opt))

    serialized = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is LossScaleOptimizer
    assert deserialized.get_config() == config
    assert set(dir(deserialized)) == set(dir(opt))


def test_apply_without_variables_updates_the_built_ones():
    """Keras: loss_scale_optimizer_test.py::test_apply_with_no_vars."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    var = _weights()
    opt.build([var])
    opt.apply([tf.constant(GRAD) * opt.initial_scale])
    np.testing.assert_allclose(var.numpy(), [0.5, -1.0, -0.5, 3.0])


@pytest.mark.parametrize("mode", MODES)
def test_finite_step_is_the_inner_step_on_unscaled_gradients(mode):
    """Keras: loss_scale_optimizer_test.py::test_finite_step (stateful)."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    var = _weights()
    _applier(opt, [var], mode)(np.multiply(GRAD, opt.initial_scale))
    np.testing.assert_allclose(var.numpy(), [0.5, -1.0, -0.5, 3.0])
    alone = _weights()
    keras.optimizers.SGD(0.5).apply([tf.constant(GRAD)], [alone])
    np.testing.assert_array_equal(var.numpy(), alone.numpy())


@pytest.mark.parametrize("mode", MODES)
def test_the_inner_loss_scale_factor_is_taken_over_and_the_update_unshrunk(mode):
    """Keras: loss_scale_optimizer_test.py::test_finite_step_with_inner_loss_scale.

    As the stock class, ours sets the inner `loss_scale_factor` to None: the
    gradients of a loss scaled by the loss scale alone are divided once, so the
    weights move by 0.5, not 0.005.
    """
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5, loss_scale_factor=100.0))
    assert opt.inner_optimizer.loss_scale_factor is None
    assert float(opt.scale_loss(tf.constant(1.0))) == opt.initial_scale
    var = _weights()
    _applier(opt, [var], mode)(np.multiply(GRAD, opt.initial_scale))
    np.testing.assert_allclose(var.numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-6)
    assert opt.get_config()["inner_optimizer"]["config"]["loss_scale_factor"] is None


@pytest.mark.parametrize("mode", MODES)
def test_infinite_step_is_skipped_and_halves_the_scale(mode):
    """Keras: loss_scale_optimizer_test.py::test_infinite_step (stateful).

    Differs on purpose (docs/loss_scaling.md, "Skipped steps count"): the
    skipped step advances `iterations`; the stock class leaves it at 0.
    """
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    var = _weights()
    _applier(opt, [var], mode)([np.inf] * 4)
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0, 3.0, 4.0])
    assert opt.loss_scale == 2.0**14
    assert opt.skipped_steps == 1
    assert int(opt.iterations) == 1


def test_a_variable_overwritten_with_its_gradient_takes_it_as_given():
    """Keras: loss_scale_optimizer_test.py::test_finite_step_with_overwrite (stateful).

    A float8 scale or amax history takes its "gradient" as its new value: it
    is neither unscaled nor judged.
    """
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    var = _weights()
    var.overwrite_with_gradient = True
    opt.apply([tf.constant(GRAD)], [var])
    np.testing.assert_array_equal(var.numpy(), GRAD)


@pytest.mark.parametrize("mode", MODES)
def test_four_overflows_take_the_scale_from_400_to_25(mode):
    """Keras: loss_scale_optimizer_test.py::test_downscaling (stateful)."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=400.0)
    var = _weights()
    opt.build([var])
    apply = _applier(opt, [var], mode)
    for _ in range(4):
        apply([np.inf] * 4)
    assert float(opt.scale_loss(tf.constant(1.0))) == 25.0


@pytest.mark.parametrize("mode", MODES)
def test_eight_finite_steps_grow_the_scale_from_2_to_32(mode):
    """Keras: loss_scale_optimizer_test.py::test_upscaling (stateful), Keras' settings."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=2.0, dynamic_growth_steps=2)
    var = _weights()
    opt.build([var])
    apply = _applier(opt, [var], mode)
    for _ in range(8):
        apply(GRAD)
    assert float(opt.scale_loss(tf.constant(1.0))) == 32.0


def test_scale_loss_takes_a_python_number():
    """Keras: loss_scale_optimizer_test.py::test_downscaling, test_upscaling (`scale_loss(1.0)`)."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=400.0)
    assert float(opt.scale_loss(1.0)) == 400.0
    assert float(opt.scale_loss(2)) == 800.0


def test_iterations_count_every_step_skipped_or_not():
    """Keras: loss_scale_optimizer_test.py::test_iterations_update (stateful).

    Differs on purpose (docs/loss_scaling.md, "Skipped steps count"): the
    fourth, skipped step advances `iterations` too; the stock class would stay
    at 3.
    """
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    var = _weights()
    opt.build([var])
    assert int(opt.iterations) == 0
    for step in range(1, 4):
        opt.apply([tf.constant(GRAD)], [var])
        assert int(opt.iterations) == step
    opt.apply([tf.constant([np.nan] * 4)], [var])
    assert int(opt.iterations) == 4
    assert opt.skipped_steps == 1


def test_config_holds_the_stock_keys_then_ours_and_loads_back():
    """Keras: loss_scale_optimizer_test.py::test_serialization.

    Differs on purpose: after the stock four keys come our settings (floor,
    ceiling, factors, hysteresis, `dynamic`, ...), so the config has 12 keys.
    """
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=3.0, dynamic_growth_steps=2, name="parity_opt"
    )
    config = opt.get_config()
    assert list(config)[:4] == ["name", "inner_optimizer", "initial_scale", "dynamic_growth_steps"]
    assert (config["name"], config["initial_scale"], config["dynamic_growth_steps"]) == (
        "parity_opt",
        3.0,
        2,
    )
    assert set(list(config)[4:]) == {
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
        "dynamic",
        "all_reduce_dtype",
    }
    # from_config takes `inner_optimizer` out of the dict it is given (the stock one too).
    revived = LossScaleOptimizer.from_config(copy.deepcopy(config))
    assert (revived.name, revived.initial_scale, revived.growth_interval) == ("parity_opt", 3.0, 2)
    # The stock class's config of the same optimizer: the same four keys, and
    # ours loads it with the same settings.
    stock_config = keras.optimizers.LossScaleOptimizer(
        opt.inner_optimizer, initial_scale=3.0, dynamic_growth_steps=2, name="parity_opt"
    ).get_config()
    assert stock_config == {key: config[key] for key in stock_config}
    assert LossScaleOptimizer.from_config(stock_config).get_config() == config


def test_dynamic_false_is_supported_and_pins_the_scale():
    """Keras: loss_scale_optimizer_test.py::test_init_dynamic_arg.

    Differs on purpose (docs/loss_scaling.md, "Fixed scale"): the stock class
    raises for `dynamic=False`; ours keeps the scale at `initial_scale` and
    still skips non-finite steps.
    """
    LossScaleOptimizer(keras.optimizers.SGD(0.5), dynamic=True)
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), dynamic=False, initial_scale=8.0, dynamic_growth_steps=1
    )
    var = _weights()
    opt.apply([tf.constant(GRAD) * 8.0], [var])
    opt.apply([tf.constant([np.inf] * 4)], [var])
    np.testing.assert_allclose(var.numpy(), [0.5, -1.0, -0.5, 3.0])
    assert (opt.loss_scale, opt.skipped_steps) == (8.0, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(foo=True, bar=3), "LossScaleOptimizer does not support arguments: `foo`, `bar`."),
        (
            dict(learning_rate=0.1),
            "LossScaleOptimizer does not support arguments: `learning_rate`.",
        ),
    ],
    ids=["unknown", "learning_rate"],
)
def test_unsupported_arguments_are_named(kwargs, message):
    """Keras: loss_scale_optimizer_test.py::test_init_unsupported_arg (inherited check)."""
    with pytest.raises(ValueError) as raised:
        LossScaleOptimizer(keras.optimizers.SGD(0.5), **kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("weight_decay", 0.5),
        ("clipnorm", 0.5),
        ("global_clipnorm", 0.5),
        ("clipvalue", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
    ],
)
def test_base_optimizer_arguments_belong_on_the_inner_optimizer(name, value):
    """Keras: loss_scale_optimizer_test.py::test_init_base_optimizer_unsupported_args."""
    with pytest.raises(ValueError) as raised:
        LossScaleOptimizer(keras.optimizers.SGD(0.5), **{name: value})
    assert str(raised.value) == (
        f"LossScaleOptimizer does not support `{name}`. "
        f"Instead, set `{name}` on the `inner_optimizer`."
    )


def test_an_old_stock_config_with_the_base_optimizer_defaults_loads():
    """Keras: loss_scale_optimizer_test.py::test_deserialization_backwards_compatibility."""
    base_defaults = {
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
    }
    config = {
        "name": "old_lso",
        **base_defaults,
        "inner_optimizer": {
            "module": "keras.optimizers",
            "class_name": "SGD",
            "config": {
                "name": "SGD",
                "learning_rate": 0.25,
                **base_defaults,
                "momentum": 0.0,
                "nesterov": False,
            },
            "registered_name": None,
        },
        "initial_scale": 4.0,
        "dynamic_growth_steps": 3,
    }
    opt = LossScaleOptimizer.from_config(config)
    assert type(opt) is LossScaleOptimizer
    assert (opt.name, opt.initial_scale, opt.growth_interval) == ("old_lso", 4.0, 3)
    assert type(opt.inner_optimizer) is keras.optimizers.SGD
    assert float(opt.inner_optimizer.learning_rate) == 0.25


# --- keras/src/optimizers/multi_optimizer_test.py ---------------------------


def _scoped(scope: str, value: list[list[float]], name: str = "kernel") -> keras.Variable:
    with keras.name_scope(scope):
        return keras.Variable(value, name=name)


def test_multi_optimizer_map_inside_ours_routes_each_variable():
    """Keras: multi_optimizer_test.py::test_stateful_apply, wrapped in ours."""
    slow, fast, frozen = (keras.optimizers.SGD(lr) for lr in (0.1, 1.0, 0.0))
    optimizer_map = keras.optimizers.OptimizerMap(default_optimizer=frozen)
    optimizer_map["^encoder/.*"] = slow
    optimizer_map["^head/.*"] = fast
    opt = LossScaleOptimizer(keras.optimizers.MultiOptimizer(optimizer_map), initial_scale=64.0)
    encoder = _scoped("encoder", [[2.0, 2.0]])
    head = _scoped("head", [[3.0, 3.0]])
    other = _scoped("other", [[4.0, 4.0]])
    opt.build([encoder, head, other])
    opt.apply([tf.constant([[64.0, 64.0]])] * 3, [encoder, head, other])
    np.testing.assert_allclose(encoder.numpy(), [[1.9, 1.9]])
    np.testing.assert_allclose(head.numpy(), [[2.0, 2.0]])
    np.testing.assert_allclose(other.numpy(), [[4.0, 4.0]])
    assert int(opt.iterations) == int(opt.inner_optimizer.iterations) == 1
    assert [int(sub.iterations) for sub in (slow, fast, frozen)] == [1, 1, 1]


def test_multi_optimizer_with_a_callable_selector_inside_ours():
    """Keras: multi_optimizer_test.py::test_custom_callable_function, wrapped in ours."""
    adam, sgd = keras.optimizers.Adam(1e-3), keras.optimizers.SGD(1e-2)
    multi = keras.optimizers.MultiOptimizer(lambda v: adam if "encoder" in v.path else sgd)
    opt = LossScaleOptimizer(multi, initial_scale=16.0)
    encoder, head = _scoped("encoder", [[1.0]]), _scoped("head", [[1.0]])
    opt.build([encoder, head])
    assert multi.optimizers == [adam, sgd]
    opt.apply([tf.constant([[16.0]]), tf.constant([[16.0]])], [encoder, head])
    np.testing.assert_allclose(head.numpy(), [[0.99]])
    adam_alone = _scoped("encoder", [[1.0]])
    keras.optimizers.Adam(1e-3).apply([tf.constant([[1.0]])], [adam_alone])
    np.testing.assert_allclose(encoder.numpy(), adam_alone.numpy(), rtol=1e-6)


def test_multi_optimizer_inside_ours_serializes_with_its_map():
    """Keras: multi_optimizer_test.py::test_serialization, wrapped in ours."""
    optimizer_map = keras.optimizers.OptimizerMap(
        default_optimizer=keras.optimizers.RMSprop(1e-4),
        optimizer_map={
            "^encoder/.*": keras.optimizers.Adam(1e-3),
            "^head/.*": keras.optimizers.SGD(1e-2),
        },
    )
    opt = LossScaleOptimizer(keras.optimizers.MultiOptimizer(optimizer_map), initial_scale=8.0)
    scopes = ("encoder", "head", "other")
    opt.build([_scoped(scope, [[1.0]]) for scope in scopes])
    serialized = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    revived = keras.saving.deserialize_keras_object(serialized)
    assert type(revived) is LossScaleOptimizer and revived.initial_scale == 8.0
    variables = [_scoped(scope, [[1.0]]) for scope in scopes]
    revived.apply([tf.constant([[8.0]])] * 3, variables)
    subs = revived.inner_optimizer.optimizers
    assert [type(sub).__name__ for sub in subs] == ["Adam", "SGD", "RMSprop"]
    # Each variable moved as its own optimizer alone moves it: the map survived.
    for variable, alone in zip(
        variables,
        [keras.optimizers.Adam(1e-3), keras.optimizers.SGD(1e-2), keras.optimizers.RMSprop(1e-4)],
    ):
        reference = keras.Variable([[1.0]])
        alone.apply([tf.constant([[1.0]])], [reference])
        np.testing.assert_allclose(variable.numpy(), reference.numpy(), rtol=1e-6)


def test_a_multi_optimizers_loss_scale_factor_is_taken_over_by_ours():
    """Keras: multi_optimizer_test.py::test_multi_optimizer_wrapped_in_loss_scale_optimizer.

    Also test_loss_scaling and test_gradient_unscaling with ours around the
    MultiOptimizer: the factor is set to None on the MultiOptimizer and its
    sub-optimizers, `scale_loss` multiplies by the loss scale alone, and the
    gradients are unscaled once.
    """
    slow, fast = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(default_optimizer=fast, optimizer_map={".*encoder/.*": slow}),
        loss_scale_factor=5.0,
    )
    opt = LossScaleOptimizer(multi, initial_scale=10.0, dynamic_growth_steps=1000)
    encoder, head = _scoped("encoder", [[2.0, 2.0]]), _scoped("head", [[2.0, 2.0]])
    opt.build([encoder, head])
    assert (multi.loss_scale_factor, slow.loss_scale_factor, fast.loss_scale_factor) == (None,) * 3
    assert float(opt.scale_loss(tf.constant(2.0))) == 20.0
    # The gradient of the loss scaled by 10: unscaled 1.0 for each variable.
    opt.apply([tf.constant([[10.0, 10.0]])] * 2, [encoder, head])
    np.testing.assert_allclose(encoder.numpy(), [[1.9, 1.9]])
    np.testing.assert_allclose(head.numpy(), [[1.9, 1.9]])


def _two_dense_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.layers.Dense(2, kernel_initializer="ones", use_bias=False, name="dense_1"),
            keras.layers.Dense(1, kernel_initializer="ones", use_bias=False, name="dense_2"),
        ]
    )


def test_multi_optimizer_inside_ours_trains_a_model():
    """Keras: multi_optimizer_test.py::test_multi_optimizer_with_model_fit, wrapped in ours."""
    unused = keras.optimizers.SGD(0.1)
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            default_optimizer=unused,
            optimizer_map={
                ".*dense_1/.*": keras.optimizers.SGD(1e-3),
                ".*dense_2/.*": keras.optimizers.SGD(1e-2),
            },
        )
    )
    opt = LossScaleOptimizer(multi)
    model = _two_dense_model()
    model.compile(loss="mse", optimizer=opt, run_eagerly=True)
    assert model.optimizer is opt
    model.fit(np.ones((1, 1), "float32"), np.zeros((1, 1), "float32"), batch_size=1, verbose=0)
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), [[0.996, 0.996]], rtol=1e-6)
    np.testing.assert_allclose(model.layers[1].kernel.numpy(), [[0.96], [0.96]], rtol=1e-6)
    assert int(opt.iterations) == 1
    assert [int(sub.iterations) for sub in multi.optimizers] == [1, 1, 0]


def test_ours_cannot_go_inside_a_multi_optimizer():
    """Keras: multi_optimizer_test.py::test_multi_optimizer_blocks_nested_optimizers."""
    sgd = keras.optimizers.SGD(0.1)
    ours = LossScaleOptimizer(sgd)
    optimizer_map = keras.optimizers.OptimizerMap(default_optimizer=sgd)
    with pytest.raises(ValueError, match="optimizer cannot be LossScaleOptimizer."):
        optimizer_map[".*"] = ours
    # Put in behind the map's back (as Keras' test does), it is caught when
    # the MultiOptimizer builds.
    optimizer_map._optimizer_map = {".*encoder/.*": ours}
    with pytest.raises(
        ValueError, match="LossScaleOptimizer cannot be used inside an MultiOptimizer."
    ):
        keras.optimizers.MultiOptimizer(optimizer_map).build([_scoped("encoder", [[1.0]])])


def test_swap_ema_weights_swaps_only_the_ema_sub_optimizers_variables_inside_ours():
    """Keras: multi_optimizer_test.py::test_swap_ema_weights_with_multi_optimizer, in ours.

    Only the variables of the sub-optimizer with `use_ema=True` are swapped
    for evaluation, and all are restored after.
    """
    with_ema = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)
    without_ema = keras.optimizers.SGD(0.1)
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            default_optimizer=without_ema, optimizer_map={".*dense_1/.*": with_ema}
        )
    )
    model = _two_dense_model()
    model.compile(loss="mse", optimizer=LossScaleOptimizer(multi))
    model.train_on_batch(np.ones((1, 1), "float32"), np.ones((1, 1), "float32"))
    first, second = model.layers[0].kernel, model.layers[1].kernel
    first.assign([[2.0, 2.0]])
    second.assign([[3.0], [3.0]])
    average = with_ema._model_variables_moving_average[0]
    average.assign([[9.0, 9.0]])

    swap = keras.callbacks.SwapEMAWeights()
    swap.set_model(model)
    swap.on_test_begin()
    np.testing.assert_array_equal(first.numpy(), [[9.0, 9.0]])
    np.testing.assert_array_equal(average.numpy(), [[2.0, 2.0]])
    np.testing.assert_array_equal(second.numpy(), [[3.0], [3.0]])
    swap.on_test_end()
    np.testing.assert_array_equal(first.numpy(), [[2.0, 2.0]])
    np.testing.assert_array_equal(average.numpy(), [[9.0, 9.0]])
    np.testing.assert_array_equal(second.numpy(), [[3.0], [3.0]])


def test_tensorboard_logs_each_sub_optimizers_learning_rate_through_ours(tmp_path):
    """Keras: multi_optimizer_test.py::test_tensorboard_logging_with_multi_optimizer, in ours.

    The TensorBoard callback looks through `inner_optimizer`; Keras' test
    calls its `_collect_learning_rate` (Keras 3.15.1), so does this one.
    """
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            default_optimizer=keras.optimizers.SGD(0.01, name="head_sgd"),
            optimizer_map={".*dense_1/.*": keras.optimizers.SGD(0.1, name="encoder_sgd")},
        )
    )
    model = _two_dense_model()
    model.compile(loss="mse", optimizer=LossScaleOptimizer(multi))
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    board.set_model(model)
    logs = board._collect_learning_rate({})
    assert set(logs) == {"learning_rate_encoder_sgd", "learning_rate_head_sgd"}
    np.testing.assert_allclose(logs["learning_rate_encoder_sgd"], 0.1)
    np.testing.assert_allclose(logs["learning_rate_head_sgd"], 0.01)


def test_learning_rate_callbacks_set_the_inner_optimizers_rate_through_ours():
    """The learning-rate callbacks change the inner optimizer's rate through ours.

    Keras: multi_optimizer_test.py::test_learning_rate_scheduler_with_multi_optimizer
    and ::test_reduce_lr_on_plateau_with_multi_optimizer, with a single inner
    optimizer: in Keras 3.15.1 both callbacks look for
    `optimizers` on the model's optimizer only, so with a MultiOptimizer
    inside any loss-scale optimizer (the stock one too) they raise 'Optimizer
    must have a "learning_rate" attribute'. Ours, like the stock class, passes
    `learning_rate` through to the inner optimizer.
    """
    inner = keras.optimizers.SGD(0.1)
    model = _two_dense_model()
    model.compile(loss="mse", optimizer=LossScaleOptimizer(inner))
    scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)
    scheduler.set_model(model)
    scheduler.on_epoch_begin(epoch=1)
    np.testing.assert_allclose(float(inner.learning_rate), 0.05)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1)
    plateau.set_model(model)
    plateau.on_train_begin()
    plateau.on_epoch_end(epoch=0, logs={"val_loss": 1.0})
    np.testing.assert_allclose(float(inner.learning_rate), 0.05)
    plateau.on_epoch_end(epoch=1, logs={"val_loss": 1.0})
    np.testing.assert_allclose(float(inner.learning_rate), 0.025)


# --- keras/src/optimizers/optimizer_sparse_test.py --------------------------


class _WriteGradient(keras.optimizers.Optimizer):
    """Writes each gradient into its variable and into a slot (sparse in, sparse out)."""

    def __init__(self) -> None:
        super().__init__(learning_rate=0.001)

    def build(self, variables: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(variables)
        self.last_gradients = [
            self.add_variable_from_reference(v, name="last_gradient") for v in variables
        ]

    def update_step(self, gradient: Any, variable: keras.Variable, learning_rate: Any) -> None:
        slot = self.last_gradients[self._get_variable_index(variable)]
        self.assign(slot, keras.ops.cast(gradient, slot.dtype))
        self.assign(variable, keras.ops.cast(gradient, variable.dtype))


# Keras' TEST_CASES: the inner optimizer's class and arguments, whether the
# model variable gets a sparse update, whether a slot does. Keras'
# "loss_scale_optimizer_sgd" case (its stock class around SGD(0.5)) is ours
# around SGD(0.5).
_SGD, _RMSPROP = keras.optimizers.SGD, keras.optimizers.RMSprop
SPARSE_CASES = [
    pytest.param(keras.optimizers.Adadelta, {}, True, False, id="adadelta"),
    pytest.param(keras.optimizers.Adafactor, dict(clip_threshold=0.5), True, False, id="adafactor"),
    pytest.param(keras.optimizers.Adagrad, {}, True, True, id="adagrad"),
    pytest.param(keras.optimizers.Adam, {}, False, False, id="adam"),
    pytest.param(keras.optimizers.Adam, dict(amsgrad=True), False, False, id="adam_amsgrad"),
    pytest.param(keras.optimizers.Adamax, {}, False, False, id="adamax"),
    pytest.param(keras.optimizers.AdamW, {}, False, False, id="adamw"),
    pytest.param(keras.optimizers.AdamW, dict(amsgrad=True), False, False, id="adamw_amsgrad"),
    pytest.param(keras.optimizers.Ftrl, {}, False, False, id="ftrl"),
    pytest.param(keras.optimizers.Lion, {}, False, False, id="lion"),
    pytest.param(_SGD, dict(learning_rate=0.5), True, False, id="loss_scale_optimizer_sgd"),
    pytest.param(keras.optimizers.Nadam, {}, False, False, id="nadam"),
    pytest.param(_RMSPROP, {}, True, False, id="rmsprop"),
    pytest.param(_RMSPROP, dict(momentum=0.05), False, False, id="rmsprop_momentum"),
    pytest.param(
        _RMSPROP, dict(momentum=0.05, centered=True), False, False, id="rmsprop_momentum_centered"
    ),
    pytest.param(_SGD, {}, True, False, id="sgd"),
    pytest.param(_SGD, dict(momentum=0.05), False, False, id="sgd_momentum"),
    pytest.param(
        _SGD, dict(momentum=0.05, nesterov=True), False, False, id="sgd_momentum_nesterov"
    ),
    pytest.param(_WriteGradient, {}, True, True, id="scatter_update"),
]


def _rows(values: tf.Tensor, dense_shape: tuple[int, ...]) -> tf.IndexedSlices:
    """A sparse gradient for rows 0, 2 and 4."""
    return tf.IndexedSlices(values, tf.constant([0, 2, 4]), tf.constant(dense_shape))


@pytest.mark.parametrize(("inner_class", "kwargs", "sparse_variable", "sparse_slot"), SPARSE_CASES)
def test_sparse_gradients_reach_the_variable_through_the_inner_assign(
    inner_class, kwargs, sparse_variable, sparse_slot
):
    """Keras: optimizer_sparse_test.py::test_sparse_gradients, each case wrapped in ours.

    The inner optimizer writes the model variable and its slots only through
    `self.assign*` (a sparse gradient stays sparse where Keras' case expects
    it), never by calling the variable's own `assign*`. Ours writes its own
    counters (never a gradient) directly: those are allowed.
    """
    opt = LossScaleOptimizer(inner_class(**kwargs), initial_scale=1024.0)
    inner = opt.inner_optimizer
    var = keras.Variable(np.ones((5, 10), np.float32), name="table")
    opt.build([var])
    inner_variables = {id(v) for v in inner.variables}
    ours = {id(v.value) for v in opt.variables if id(v) not in inner_variables}
    sparse_writes, direct_writes = set(), []

    def through_optimizer(variable: Any, value: Any) -> None:
        target = variable.value if isinstance(variable, keras.Variable) else variable
        if isinstance(value, tf.IndexedSlices):
            sparse_writes.add("variable" if target is var.value else "slot")

    def direct(variable: tf.Variable, *args: Any, **options: Any) -> None:
        if id(variable) not in ours and variable.shape.rank:
            direct_writes.append(variable.name)

    resource_variable = type(var.value)
    with (
        mock.patch.object(inner, "_apply_weight_decay", autospec=True),
        mock.patch.object(inner, "assign", autospec=True, side_effect=through_optimizer),
        mock.patch.object(inner, "assign_add", autospec=True, side_effect=through_optimizer),
        mock.patch.object(inner, "assign_sub", autospec=True, side_effect=through_optimizer),
        mock.patch.object(resource_variable, "assign", autospec=True, side_effect=direct),
        mock.patch.object(resource_variable, "assign_add", autospec=True, side_effect=direct),
        mock.patch.object(resource_variable, "assign_sub", autospec=True, side_effect=direct),
    ):
        opt.apply([_rows(tf.fill((3, 10), 512.0), (5, 10))], [var])
    assert direct_writes == []
    assert ("variable" in sparse_writes) == sparse_variable
    assert ("slot" in sparse_writes) == sparse_slot


@pytest.mark.parametrize(("inner_class", "kwargs", "sparse_variable", "sparse_slot"), SPARSE_CASES)
def test_sparse_gradients_update_as_the_inner_optimizer_alone(
    inner_class, kwargs, sparse_variable, sparse_slot
):
    """Keras: optimizer_sparse_test.py::test_sparse_correctness, each case wrapped in ours.

    Ours with scaled sparse gradients against the inner optimizer alone with
    the same sparse gradients unscaled, step by step. (That sparse and dense
    gradients agree is the inner optimizer's business, which Keras' test
    checks; a scatter-update optimizer leaves the rows without a gradient
    alone, so for it they do not.)
    """
    shape = (5, 3, 2)
    opt = LossScaleOptimizer(inner_class(**kwargs), initial_scale=1024.0, growth_interval=100)
    alone = inner_class(**kwargs)
    var = keras.Variable(np.ones(shape, np.float32), name="ours")
    reference = keras.Variable(np.ones(shape, np.float32), name="alone")
    for step in range(4):
        values = tf.fill((3, 3, 2), 8.0 - step)
        opt.apply([_rows(values * 1024.0, shape)], [var])
        alone.apply([_rows(values, shape)], [reference])
        np.testing.assert_allclose(var.numpy(), reference.numpy(), rtol=1e-6, atol=1e-6)
    assert opt.skipped_steps == 0


# --- keras/src/callbacks/swap_ema_weights_test.py ---------------------------


def _ema_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 2, size=10), 2)
    return x, y


def _ema_model(
    inner: keras.optimizers.Optimizer, ours: bool = True, **compile_kwargs: Any
) -> keras.Model:
    model = keras.Sequential([keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)])
    model.compile(
        optimizer=LossScaleOptimizer(inner) if ours else inner,
        loss="mse",
        metrics=[keras.metrics.MeanSquaredError()],
        **compile_kwargs,
    )
    return model


def _ema_sgd(use_ema: bool = True) -> keras.optimizers.SGD:
    return keras.optimizers.SGD(use_ema=use_ema, ema_momentum=0.9)


def test_swap_ema_weights_needs_use_ema_on_the_inner_optimizer():
    """Keras: swap_ema_weights_test.py::test_swap_ema_weights_with_invalid_optimizer."""
    x, y = _ema_data()
    model = _ema_model(_ema_sgd(use_ema=False))
    with pytest.raises(ValueError, match="SwapEMAWeights must be used when `use_ema=True` is set"):
        model.fit(
            x,
            y,
            epochs=1,
            callbacks=[keras.callbacks.SwapEMAWeights()],
            validation_data=(x, y),
            verbose=0,
        )


def test_swap_ema_weights_validates_with_the_ema_weights_as_the_inner_alone():
    """With SwapEMAWeights, validation sees the EMA weights, as with the inner alone.

    Keras: swap_ema_weights_test.py::test_swap_ema_weights and
    ::test_swap_ema_weights_with_loss_scale_optimizer (jit_compile=True, as
    there). Without the callback, the last validation (trained weights) differs from
    evaluating after fit (EMA weights, written by `finalize_variable_values`);
    with it, they are the same. Either way ours gives what the inner optimizer
    alone gives.
    """
    x, y = _ema_data()
    results = {}
    for ours in (True, False):
        for swap in (True, False):
            model = _ema_model(_ema_sgd(), ours=ours, jit_compile=True)
            history = model.fit(
                x,
                y,
                epochs=2,
                callbacks=[keras.callbacks.SwapEMAWeights()] if swap else [],
                validation_data=(x, y),
                verbose=0,
            )
            logs = model.evaluate(x, y, return_dict=True, verbose=0)
            results[ours, swap] = (
                history.history["val_mean_squared_error"][-1],
                logs["mean_squared_error"],
                model.layers[0].kernel.numpy(),
            )
    assert results[True, False][0] != results[True, False][1]
    assert results[True, True][0] == results[True, True][1]
    for swap in (True, False):
        np.testing.assert_allclose(results[True, swap][:2], results[False, swap][:2], rtol=1e-6)
        np.testing.assert_allclose(results[True, swap][2], results[False, swap][2], rtol=1e-6)


def test_swap_ema_weights_swaps_in_for_evaluation_and_restores_after():
    """Keras: swap_ema_weights_test.py (what test_swap_ema_weights relies on), with ours."""
    x, y = _ema_data()
    inner = _ema_sgd()
    model = _ema_model(inner)
    model.train_on_batch(x, y)
    kernel = model.layers[0].kernel
    kernel.assign([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    average = inner._model_variables_moving_average[0]
    average.assign(np.full((3, 2), 0.5, np.float32))

    seen: list[np.ndarray] = []

    class Watch(keras.callbacks.Callback):
        def on_test_batch_begin(self, batch, logs=None):
            seen.append(kernel.numpy().copy())

    model.evaluate(x, y, callbacks=[keras.callbacks.SwapEMAWeights(), Watch()], verbose=0)
    np.testing.assert_array_equal(seen[0], np.full((3, 2), 0.5))
    np.testing.assert_array_equal(kernel.numpy(), [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(average.numpy(), np.full((3, 2), 0.5))


def test_swap_ema_weights_on_epoch_checkpoints_the_ema_weights(tmp_path):
    """Keras: swap_ema_weights_test.py::test_swap_ema_weights_on_epoch, with ours.

    The `.keras` file holds ours (registered as `mpt_keras>LossScaleOptimizer`)
    and loads back.
    """
    x, y = _ema_data()
    model = _ema_model(_ema_sgd())
    model.fit(
        x,
        y,
        epochs=2,
        callbacks=[
            keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "{epoch:1d}.keras")),
        ],
        validation_data=(x, y),
        verbose=0,
    )
    loaded = keras.saving.load_model(tmp_path / "2.keras")
    assert type(loaded.optimizer) is LossScaleOptimizer
    logs = model.evaluate(x, y, return_dict=True, verbose=0)
    loaded_logs = loaded.evaluate(x, y, return_dict=True, verbose=0)
    assert logs["mean_squared_error"] == loaded_logs["mean_squared_error"]


# --- tf.distribute (the two-CPU host, see the module docstring) -------------


@pytest.fixture(scope="module")
def distributed() -> dict[str, Any]:
    return run_on_two_cpus("test_keras_parity", "_distributed_results")


def test_swap_ema_weights_under_mirrored_strategy(distributed):
    """Keras: swap_ema_weights_test.py::test_swap_ema_weights_with_tf_distribute, with ours."""
    result = distributed["swap_ema"]
    assert result["loaded_optimizer"] == "LossScaleOptimizer"
    assert result["mse"] == result["loaded_mse"]


def test_fit_under_mirrored_strategy_from_arrays_and_a_distributed_dataset(distributed):
    """Keras: integration_tests/tf_distribute_training_test.py::test_model_fit, with ours.

    The Keras test only checks that both fits run; this one also checks that
    ours trains as the inner optimizer alone under the same strategy.
    """
    ours, alone = distributed["fit"]["ours"], distributed["fit"]["alone"]
    assert ours["iterations"] == alone["iterations"] == 2 * 4 + 2 * 5
    assert ours["skipped_steps"] == 0
    np.testing.assert_allclose(ours["losses"], alone["losses"], rtol=1e-5)
    for got, want in zip(ours["weights"], alone["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _distributed_fit(strategy: tf.distribute.Strategy, ours: bool) -> dict[str, Any]:
    keras.utils.set_random_seed(1337)
    rng = np.random.default_rng(1337)
    x = rng.random((160, 8)).astype("float32")
    y = rng.random((160, 4)).astype("float32")
    with strategy.scope():
        inputs = keras.Input((8,), batch_size=32)
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        hidden = keras.layers.BatchNormalization()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        inner = keras.optimizers.SGD(learning_rate=0.01, momentum=0.01)
        model.compile(
            optimizer=LossScaleOptimizer(inner) if ours else inner,
            loss="mse",
            metrics=[keras.metrics.MeanSquaredError()],
            jit_compile=False,
        )
        # From arrays (4 steps of 32 after the validation split), then from
        # a distributed dataset (5 steps).
        first = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.2, verbose=0)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        )
        second = model.fit(dataset, epochs=2, verbose=0)
    optimizer = model.optimizer
    return {
        "iterations": int(optimizer.iterations.numpy()),
        "skipped_steps": optimizer.skipped_steps if ours else 0,
        "losses": first.history["loss"] + second.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
    }


def _distributed_swap_ema(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    x, y = _ema_data()
    with strategy.scope():
        model = _ema_model(_ema_sgd(), jit_compile=False)
        with tempfile.TemporaryDirectory() as directory:
            model.fit(
                x,
                y,
                epochs=2,
                callbacks=[
                    keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
                    keras.callbacks.ModelCheckpoint(os.path.join(directory, "{epoch:1d}.keras")),
                ],
                validation_data=(x, y),
                verbose=0,
            )
            loaded = keras.saving.load_model(os.path.join(directory, "2.keras"))
    return {
        "loaded_optimizer": type(loaded.optimizer).__name__,
        "mse": model.evaluate(x, y, return_dict=True, verbose=0)["mean_squared_error"],
        "loaded_mse": loaded.evaluate(x, y, return_dict=True, verbose=0)["mean_squared_error"],
    }


def _distributed_results() -> dict[str, Any]:
    """Runs the tf.distribute cases; needs two logical CPU devices."""
    strategy = two_cpu_strategy()
    return {
        "fit": {
            "ours": _distributed_fit(strategy, ours=True),
            "alone": _distributed_fit(strategy, ours=False),
        },
        "swap_ema": _distributed_swap_ema(strategy),
    }

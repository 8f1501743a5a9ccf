"""Tests for mpt_keras.scaling.optimizer.LossScaleOptimizer.

Single-device cases run in the pytest process. The tf.distribute cases need the
CPU split into two logical devices before TensorFlow initializes its devices,
which the pytest process may already have done, so they run once in a child
process (`replicas.run_child` imports this module and calls `_distributed_results`)
and the tests assert on the JSON it prints. That keeps this file runnable alone
and together with other test files.

Where the stock `keras.optimizers.LossScaleOptimizer` (Keras 3.15.1) gets a case
wrong, a `*_stock_*` test pins its wrong value as documentation of the bug.
"""

from __future__ import annotations

import copy
import doctest
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from replicas import run_child

import mpt_keras.scaling.optimizer as lso_module
from mpt_keras.scaling.optimizer import LossScaleOptimizer

StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer

FINITE = [1.0, 2.0]
NAN = [np.nan, 2.0]
INF = [np.inf, 2.0]
MODES = ["eager", "function", "jit"]

_TESTS_DIR = Path(__file__).resolve().parent


def _stepper(
    mode: str,
    inner: keras.optimizers.Optimizer | None = None,
    cls: Callable[..., Any] = LossScaleOptimizer,
    shape: tuple[int, ...] = (2,),
    **kwargs: Any,
) -> tuple[keras.Variable, Any, Callable[[Sequence[float]], None]]:
    """A built optimizer on one variable of ones and a step(grad) function."""
    var = keras.Variable(np.ones(shape, np.float32), name="w")
    opt = cls(inner or keras.optimizers.SGD(0.5), **kwargs)
    opt.build([var])

    def apply(grad: tf.Tensor) -> None:
        opt.apply([grad], [var])

    if mode != "eager":
        apply = tf.function(apply, jit_compile=mode == "jit")
    return var, opt, lambda grad: apply(tf.constant(grad, tf.float32))


def _scale(opt: Any) -> float:
    return float(opt.dynamic_scale.numpy())


def _scaled(grad: Sequence[float], opt: Any) -> np.ndarray:
    """`grad` as the optimizer receives it from a loss scaled by its scale."""
    return np.multiply(grad, _scale(opt))


# --- Scale dynamics -------------------------------------------------------
# The trajectories, skips, per-variable counts and norm overflow run on both backends:
# tests/any_backend/test_loss_scaling.py.


@pytest.mark.parametrize("mode", MODES)
def test_dynamics_in_every_execution_mode(mode):
    var, opt, step = _stepper(mode, initial_scale=4.0, growth_interval=2, hysteresis=2)
    trajectory = []
    for grad in [FINITE, FINITE, INF, NAN, NAN, FINITE]:
        step(_scaled(grad, opt))
        trajectory.append(opt.loss_scale)
    assert trajectory == [4, 8, 8, 4, 2, 2]
    assert opt.skipped_steps == 3
    assert isinstance(opt.loss_scale, float) and isinstance(opt.skipped_steps, int)
    np.testing.assert_allclose(var.numpy(), 1 - 0.5 * 3 * np.array(FINITE))


def test_floor_keeps_scale_and_weights_finite():
    var, opt, step = _stepper("function", initial_scale=2.0**15)
    for _ in range(200):
        step(INF)
    assert opt.loss_scale == 1.0
    step(_scaled(FINITE, opt))
    np.testing.assert_allclose(var.numpy(), [0.5, 0.0])


def test_stock_scale_underflows_to_zero_then_writes_nonfinite_weights():
    var, opt, step = _stepper("function", cls=StockLossScaleOptimizer, initial_scale=2.0**15)
    for _ in range(200):
        step(INF)
    assert _scale(opt) == 0.0
    step(_scaled(FINITE, opt))
    assert not np.isfinite(var.numpy()).any()


def test_ceiling_caps_growth():
    _, opt, step = _stepper("function", growth_interval=1)
    for _ in range(200):
        step(FINITE)
    assert opt.loss_scale == 2.0**24


def test_stock_scale_grows_to_inf_and_stays_there():
    _, opt, step = _stepper("function", cls=StockLossScaleOptimizer, dynamic_growth_steps=1)
    for _ in range(200):
        step(FINITE)
    for _ in range(5):
        step(INF)
    assert _scale(opt) == np.inf


# --- Skipped steps --------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (LossScaleOptimizer, [-0.1, -1.2]),
        # The stock class does not count the skipped step, so the schedule
        # still gives 1.0 on the third step.
        (StockLossScaleOptimizer, [-1.0, -3.0]),
    ],
    ids=["ours", "stock"],
)
def test_learning_rate_schedule_sees_skipped_steps(cls, expected):
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.1])
    var, opt, step = _stepper(
        "eager", inner=keras.optimizers.SGD(schedule), cls=cls, initial_scale=1.0
    )
    for grad in [FINITE, NAN, FINITE]:
        step(_scaled(grad, opt))
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-6)


def test_nonfinite_counts_follow_variables_given_in_any_order_or_subset():
    a = keras.Variable(np.ones(2, np.float32), name="a")
    b = keras.Variable(np.ones(3, np.float32), name="b")
    c = keras.Variable(np.ones(1, np.float32), name="c")
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0)
    opt.build([a, b, c])
    tf.function(lambda g: opt.apply([g], [b]))(tf.constant([np.nan, 1, 1]))
    tf.function(lambda gc, ga: opt.apply([gc, ga], [c, a]))(
        tf.constant([np.inf]), tf.constant([1.0, 1.0])
    )
    assert opt.nonfinite_counts() == {"a": 0, "b": 1, "c": 1}
    assert opt.skipped_steps == 2


def test_sparse_gradients_are_checked_without_densifying():
    var, opt, _ = _stepper("eager", shape=(4, 2), initial_scale=2.0)
    apply = tf.function(
        lambda values: opt.apply(
            [tf.IndexedSlices(values, tf.constant([1]), tf.constant([4, 2]))], [var]
        )
    )
    apply(tf.constant([[2.0, 4.0]]))
    apply(tf.constant([[np.nan, 4.0]]))
    np.testing.assert_allclose(var.numpy(), [[1, 1], [0.5, 0], [1, 1], [1, 1]])
    assert opt.nonfinite_counts() == {"w": 1}


# --- Inner optimizer features --------------------------------------------


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.1),
        lambda: keras.optimizers.AdamW(0.1, weight_decay=0.5),
        lambda: keras.optimizers.SGD(0.1, clipnorm=1.0),
        lambda: keras.optimizers.SGD(0.1, global_clipnorm=1.0),
        lambda: keras.optimizers.SGD(0.1, clipvalue=0.5),
    ],
    ids=["momentum", "adam", "adamw", "clipnorm", "global_clipnorm", "clipvalue"],
)
def test_finite_steps_match_the_inner_optimizer_on_unscaled_gradients(make_inner):
    grads = [[3.0, 4.0], [-1.0, 0.5], [2.0, -2.0]]
    reference_var, _, reference_step = _stepper(
        "function", inner=make_inner(), cls=lambda inner: inner
    )
    var, opt, step = _stepper(
        "function", inner=make_inner(), initial_scale=1024.0, growth_interval=2
    )
    for grad in grads:
        reference_step(grad)
        step(_scaled(grad, opt))
    np.testing.assert_allclose(var.numpy(), reference_var.numpy(), rtol=1e-6)


def test_ema_updates_only_on_applied_steps():
    inner = keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5)
    var, opt, step = _stepper("function", inner=inner, initial_scale=1.0)
    step(FINITE)  # First step: the average starts at the new weights.
    average = inner._model_variables_moving_average[0]
    np.testing.assert_allclose(average.numpy(), [0.5, 0.0])
    step(NAN)
    np.testing.assert_allclose(average.numpy(), [0.5, 0.0])
    step(FINITE)
    np.testing.assert_allclose(var.numpy(), [0.0, -1.0])
    np.testing.assert_allclose(average.numpy(), [0.25, -0.5])


def _linear_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def _batch_gradients(model: keras.Model, x: np.ndarray, y: np.ndarray, scale: float = 1.0):
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x))
        loss = tf.reduce_mean(loss) * scale
    return tape.gradient(loss, model.trainable_variables)


def test_gradient_accumulation_drops_nonfinite_micro_batches():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(24, 3)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    micro = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 24, 4)]
    nan_x = np.full((4, 3), np.nan, np.float32)
    # Windows of 2: (A, B) both finite; (NaN, D): D alone; (NaN, NaN): nothing.
    stream = [
        micro[0],
        micro[1],
        (nan_x, micro[2][1]),
        micro[3],
        (nan_x, y[:4]),
        (nan_x, y[:4]),
    ]
    large_batches = [
        (
            np.concatenate([micro[0][0], micro[1][0]]),
            np.concatenate([micro[0][1], micro[1][1]]),
        ),
        micro[3],
    ]

    reference = _linear_model()
    reference_opt = keras.optimizers.Adam(0.05)
    for bx, by in large_batches:
        reference_opt.apply(_batch_gradients(reference, bx, by), reference.trainable_variables)

    model = _linear_model()
    inner = keras.optimizers.Adam(0.05, gradient_accumulation_steps=2)
    opt = LossScaleOptimizer(inner, initial_scale=2.0**10, growth_interval=100)
    opt.build(model.trainable_variables)
    apply = tf.function(lambda grads: opt.apply(grads, model.trainable_variables))
    for i, (bx, by) in enumerate(stream):
        apply(_batch_gradients(model, bx, by, opt.loss_scale))
        if i == 0:
            # The accumulators hold the unscaled float32 gradient of A (in the
            # order of the variables' paths).
            grads = zip(model.trainable_variables, _batch_gradients(model, bx, by))
            in_path_order = [grad for _, grad in sorted(grads, key=lambda pair: pair[0].path)]
            for acc, grad in zip(opt._accumulators, in_path_order):
                assert acc.dtype == "float32"
                np.testing.assert_allclose(acc.numpy(), grad.numpy(), rtol=1e-5)

    for got, want in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert opt.skipped_steps == 3
    # Iterations count windows (updates), as with Keras' own accumulation.
    assert int(opt.iterations) == int(inner.iterations) == 3
    assert int(opt._micro_batches.numpy()) == 6
    assert all(not acc.numpy().any() for acc in opt._accumulators)


# --- Keras integration ----------------------------------------------------


def test_keras2_custom_loop_matches_keras3_style_and_float32():
    """The TF mixed-precision guide's loop, a Keras 3 loop and no scaling agree.

    growth_interval=1 changes the scale every step, and the loops are traced
    before the optimizers are built, so a scale baked in at trace time would
    show.
    """
    rng = np.random.RandomState(1)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    models = [_linear_model() for _ in range(3)]
    guide_opt, keras3_opt = (
        LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**8, growth_interval=1)
        for _ in range(2)
    )
    plain_opt = keras.optimizers.SGD(0.1)

    def loss_fn(model: keras.Model) -> tf.Tensor:
        return tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))

    @tf.function
    def guide_step(model):
        with tf.GradientTape() as tape:
            scaled_loss = guide_opt.get_scaled_loss(loss_fn(model))
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = guide_opt.get_unscaled_gradients(scaled_grads)
        # Transforming the unscaled gradients in between is allowed.
        grads, _ = tf.clip_by_global_norm(grads, 1e6)
        guide_opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def keras3_step(model):
        with tf.GradientTape() as tape:
            scaled_loss = keras3_opt.scale_loss(loss_fn(model))
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        keras3_opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def plain_step(model):
        with tf.GradientTape() as tape:
            loss = loss_fn(model)
        plain_opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for _ in range(4):
        for step, model in zip([guide_step, keras3_step, plain_step], models):
            step(model)
    assert guide_opt.loss_scale == keras3_opt.loss_scale == 2.0**12
    for guide, keras3, plain in zip(*(m.trainable_variables for m in models)):
        np.testing.assert_allclose(guide.numpy(), plain.numpy(), rtol=1e-5)
        np.testing.assert_allclose(keras3.numpy(), plain.numpy(), rtol=1e-5)


def test_compile_under_mixed_float16_keeps_our_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _linear_model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
    assert isinstance(opt, StockLossScaleOptimizer)


def _nan_batch_data() -> tuple[np.ndarray, np.ndarray]:
    """Three batches of 4; the second one has a NaN input."""
    rng = np.random.RandomState(2)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    x[6, 1] = np.nan
    return x, y


def test_float16_gradients_underflow_without_loss_scaling():
    """Ours trains the first of 15 float16 sigmoid layers; a plain Adam does not.

    That kernel's gradient is ~1e-10, below float16's smallest subnormal (6e-8)
    unless the loss is scaled.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.RandomState(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def sigmoid_stack() -> keras.Model:
        keras.utils.set_random_seed(0)
        hidden = [keras.layers.Dense(8, activation="sigmoid") for _ in range(15)]
        return keras.Sequential(
            [keras.Input((8,)), *hidden, keras.layers.Dense(1, dtype="float32")]
        )

    model = sigmoid_stack()
    assert not _batch_gradients(model, x, y)[0].numpy().any()

    changed = {}
    for name, opt in [
        ("plain", keras.optimizers.Adam(1e-3)),
        ("ours", LossScaleOptimizer(keras.optimizers.Adam(1e-3))),
    ]:
        model = sigmoid_stack()
        first_kernel = model.layers[0].kernel
        before = first_kernel.numpy().copy()
        model.compile(optimizer=opt, loss="mse", auto_scale_loss=False)
        model.fit(x, y, batch_size=16, verbose=0)
        changed[name] = np.count_nonzero(first_kernel.numpy() != before)
    assert changed["plain"] == 0
    assert changed["ours"] > before.size // 2


# --- Configuration and state ----------------------------------------------

_CUSTOM = dict(
    initial_scale=1024.0,
    growth_factor=3.0,
    backoff_factor=0.25,
    growth_interval=7,
    hysteresis=2,
    min_scale=2.0,
    max_scale=2.0**20,
    dynamic=False,
    all_reduce_dtype="bfloat16",
)


def test_get_config_round_trips_every_argument():
    opt = LossScaleOptimizer(
        keras.optimizers.AdamW(1e-3, global_clipnorm=1.0), name="lso", **_CUSTOM
    )
    config = opt.get_config()
    # Keras' own key for the growth interval too (a drop-in's config).
    assert set(config) == {"name", "inner_optimizer", "dynamic_growth_steps", *_CUSTOM}
    assert {k: config[k] for k in _CUSTOM} == _CUSTOM
    assert config["dynamic_growth_steps"] == _CUSTOM["growth_interval"]
    restored = LossScaleOptimizer.from_config(copy.deepcopy(config))
    assert restored.get_config() == config
    serialized = keras.saving.serialize_keras_object(opt)
    assert serialized["registered_name"] == "mpt_keras>LossScaleOptimizer"
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is LossScaleOptimizer
    assert deserialized.get_config() == config
    assert deserialized.inner_optimizer.global_clipnorm == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(growth_factor=0.5),
            "Argument growth_factor: received 0.5. Allowed: a number > 1 and <= 3.40282e+38",
        ),
        (dict(growth_factor=1.0), "Argument growth_factor: received 1.0"),
        (
            dict(backoff_factor=0.0),
            "Argument backoff_factor: received 0.0. Allowed: a number > 0 and < 1",
        ),
        (dict(backoff_factor=1.0), "Argument backoff_factor: received 1.0"),
        (
            dict(growth_interval=0),
            "Argument growth_interval: received 0. Allowed: an integer >= 1",
        ),
        (dict(growth_interval=2.5), "Argument growth_interval: received 2.5"),
        (dict(growth_interval=True), "Argument growth_interval: received True"),
        (
            dict(hysteresis=0),
            "Argument hysteresis: received 0. Allowed: an integer >= 1",
        ),
        (
            dict(initial_scale=0.0),
            "Argument initial_scale: received 0.0. Allowed: a number >= 1.17549e-38 and "
            "<= 3.40282e+38",
        ),
        (dict(initial_scale=float("nan")), "Argument initial_scale: received nan"),
        (dict(initial_scale=float("inf")), "Argument initial_scale: received inf"),
        (dict(initial_scale="big"), "Argument initial_scale: received 'big'"),
        (dict(max_scale=1e39), "Argument max_scale: received 1e+39"),
        (dict(min_scale=0.0), "Argument min_scale: received 0.0"),
        (
            dict(initial_scale=0.5),
            "Argument initial_scale: received 0.5. Allowed: a number in [min_scale, max_scale] "
            "= [1.0, 16777216.0]",
        ),
        (dict(initial_scale=2.0**25), "Argument initial_scale: received 33554432.0"),
        (
            dict(min_scale=4.0, max_scale=2.0),
            "Argument max_scale: received 2.0. Allowed: a number >= min_scale (4.0)",
        ),
        (
            dict(dynamic="yes"),
            "Argument dynamic: received 'yes'. Allowed: True or False",
        ),
        (
            dict(all_reduce_dtype="int8"),
            "Argument all_reduce_dtype: received 'int8'. Allowed: None, 'float32', 'bfloat16', "
            "'float16'",
        ),
    ],
)
def test_invalid_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError) as info:
        LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "inner",
    [None, "sgd", StockLossScaleOptimizer(keras.optimizers.SGD(0.1))],
    ids=["none", "string", "loss_scale_optimizer"],
)
def test_inner_optimizer_must_be_a_plain_optimizer(inner):
    with pytest.raises(
        ValueError,
        match="Argument inner_optimizer: received .*Allowed: a keras.optimizers.Optimizer that",
    ):
        LossScaleOptimizer(inner)


def test_base_optimizer_arguments_belong_on_the_inner_optimizer():
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(keras.optimizers.SGD(0.1), clipnorm=1.0)


def test_stateless_apply_is_not_supported_on_tensorflow():
    var, opt, _ = _stepper("eager")
    with pytest.raises(ValueError, match="stateless_apply is not supported"):
        opt.stateless_apply([v.value for v in opt.variables], [tf.constant(FINITE)], [var.value])


def test_apply_in_cross_replica_context_raises():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        var, opt, step = _stepper("eager")
        with pytest.raises(ValueError, match="replica context"):
            step(FINITE)


def _trained_state() -> tuple[keras.Model, LossScaleOptimizer]:
    """A compiled model whose optimizer has a non-trivial value in every state.

    That is the scale, growth and hysteresis counters, skipped and per-variable
    counts, Adam slots and an open accumulation window.
    """
    model = _linear_model()
    inner = keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
    opt = LossScaleOptimizer(inner, initial_scale=64.0, growth_interval=3, hysteresis=2)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    kernel_nan = [
        np.full(v.shape, np.nan if i == 0 else 1.0, np.float32)
        for i, v in enumerate(model.trainable_variables)
    ]
    finite = [np.ones(v.shape, np.float32) * 64 for v in model.trainable_variables]
    for grads in [finite, finite, kernel_nan, finite, kernel_nan, finite, finite]:
        opt.apply([tf.constant(g) for g in grads], model.trainable_variables)
    return model, opt


def _state(opt: LossScaleOptimizer) -> dict[str, Any]:
    return {
        "loss_scale": opt.loss_scale,
        "skipped_steps": opt.skipped_steps,
        # Values only: a loaded model's variable paths lose the model prefix.
        "nonfinite_counts": list(opt.nonfinite_counts().values()),
        "variables": [v.numpy().tolist() for v in opt.variables],
    }


def test_trained_state_is_not_trivial():
    _, opt = _trained_state()
    state = _state(opt)
    assert state["loss_scale"] == 32.0
    assert state["skipped_steps"] == 2
    assert state["nonfinite_counts"] == [2, 0, 0, 0]
    assert int(opt.step_counter.numpy()) == 2
    assert int(opt._overflow_counter.numpy()) == 2
    assert int(opt._accumulated_counter.numpy()) == 1


def test_model_save_and_load_model_restore_all_state(tmp_path):
    model, opt = _trained_state()
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored.optimizer) is LossScaleOptimizer
    assert restored.optimizer.get_config() == opt.get_config()
    assert _state(restored.optimizer) == _state(opt)


def test_tf_train_checkpoint_restores_all_state(tmp_path):
    model, opt = _trained_state()
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh_model = _linear_model()
    fresh_opt = LossScaleOptimizer.from_config(opt.get_config())
    fresh_opt.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh_opt).restore(
        path
    ).assert_existing_objects_matched()
    assert _state(fresh_opt) == _state(opt)


def test_class_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(LossScaleOptimizer, globs=vars(lso_module)):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0


# --- tf.distribute (run in a child process, see the module docstring) ------


@pytest.fixture(scope="module")
def distributed() -> dict[str, Any]:
    return run_child("test_scaling_optimizer", "_distributed_results")


STRATEGIES = ["mirrored", "multi_worker"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bad_replica", [0, 1])
def test_nonfinite_gradient_on_one_replica_skips_on_all(distributed, strategy, bad_replica):
    result = distributed[strategy][f"nan_on_replica_{bad_replica}"]
    assert result["weights"] == [[1.0, 1.0], [1.0, 1.0]]
    assert result["scale"] == [2.0, 2.0]  # Backed off from 4 on both replicas.
    assert result["skipped_steps"] == 1
    assert result["nonfinite_counts"] == {"w": 1}
    assert result["iterations"] == 1


def test_stock_class_trusts_replica_0(distributed):
    stock = distributed["mirrored"]["stock_nan_on_replica_1"]
    assert stock["finite_weights"] is False
    assert stock["scale"] == [4.0, 4.0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("clip", "expected"),
    [
        ("clipnorm", [0.6, 0.8, 1.0]),
        ("global_clipnorm", [3 / 13, 4 / 13, 12 / 13]),
        ("clipvalue", [1.0, 1.0, 1.0]),
    ],
)
def test_clipping_after_all_reduce_matches_single_device(distributed, strategy, clip, expected):
    result = distributed[strategy][f"clip_{clip}"]
    single = distributed["single_device"][f"clip_{clip}"]
    np.testing.assert_allclose(single, expected, rtol=1e-6)
    for replica_update in result:
        np.testing.assert_allclose(replica_update, single, rtol=1e-6)


def test_stock_class_clips_per_replica(distributed):
    # Each replica clips its half to norm 1 and the halves are then summed.
    stock = distributed["mirrored"]["stock_clip_global_clipnorm"]
    assert stock == pytest.approx(1.9596, abs=1e-4)


def test_fit_under_mirrored_strategy_matches_single_device(distributed):
    result = distributed["mirrored"]["fit"]
    single = distributed["single_device"]["fit"]
    assert result["skipped_steps"] == single["skipped_steps"] == 1
    assert result["iterations"] == single["iterations"] == 3
    assert result["replica_weights_equal"]
    for got, want in zip(result["weights"], single["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The stock class applies the NaN that only replica 1 saw.
    assert distributed["mirrored"]["stock_fit_finite_weights"] is False


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_float16_update_that_overflows_is_undone_on_every_replica(distributed, strategy):
    result = distributed[strategy]["float16_update_overflow"]
    assert result["weights_after_overflow"] == [[1.0, 1.0], [1.0, 1.0]]
    assert result["weights"] == [[0.5, 0.5], [0.5, 0.5]]
    assert (result["skipped_steps"], result["iterations"]) == (1, 2)
    assert result["nonfinite_counts"] == {"w": 1}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_multi_optimizer_under_strategy_applies_the_sum_and_skips_a_nan_on_one_replica(
    distributed, strategy
):
    result = distributed[strategy]["multi_optimizer"]
    # Step 1, summed over replicas and unscaled: w gets [2, 2] (Adam's first
    # step moves each element by lr = 0.1), v gets [1, 2] (SGD: 1 - 0.5 * g).
    w, v = result["weights"]
    np.testing.assert_allclose(w, [[0.9, 0.9]] * 2, rtol=1e-5)
    np.testing.assert_allclose(v, [[0.5, 0.0]] * 2, rtol=1e-6)
    assert result["scale"] == [2.0, 2.0] and result["skipped_steps"] == 1
    assert result["iterations"] == [2, 2, 2]


def test_a_bad_batch_on_one_replica_leaves_no_nan_in_the_batch_norm_statistics(distributed):
    result = distributed["mirrored"]["batch_norm_fit"]
    assert result == {"bad_batches": 1, "finite": [True] * 4}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_under_strategy_matches_single_device(distributed, strategy):
    result = distributed[strategy]["accumulation"]
    single = distributed["single_device"]["accumulation"]
    assert result["skipped_steps"] == single["skipped_steps"] == 1
    for replica_weights in result["weights"]:
        np.testing.assert_allclose(replica_weights, single["weights"][0], rtol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("dtype", "rtol"),
    # Two roundings to 8 (bfloat16) or 11 (float16) significant bits, of each
    # replica's gradient and of their sum: up to twice the unit roundoff.
    [("float32", 0.0), ("bfloat16", 2 * 2.0**-8), ("float16", 2 * 2.0**-11)],
)
def test_all_reduce_dtype_sums_like_float32_within_its_precision(
    distributed, strategy, dtype, rtol
):
    result = distributed[strategy][f"all_reduce_{dtype}"]
    exact = distributed[strategy]["all_reduce_None"]
    assert result["wire_dtypes"] == [dtype]
    for replica_update in result["updates"]:
        np.testing.assert_allclose(replica_update, exact["updates"][0], rtol=rtol, atol=0)
    if rtol:
        # Not float32 in disguise: the rounding shows.
        assert result["updates"][0] != exact["updates"][0]
    assert exact["wire_dtypes"] == ["float32"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float16_all_reduce_overflow_skips_the_step_on_all_replicas(distributed, strategy):
    # 40000 per replica is finite in float16; their sum is not.
    result = distributed[strategy]["all_reduce_float16_overflow"]
    assert result["weights"] == [[1.0], [1.0]]
    assert result["scale"] == [0.5, 0.5]
    assert result["skipped_steps"] == 1
    assert distributed[strategy]["all_reduce_float32_no_overflow"] == [[-79999.0], [-79999.0]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_all_reduce_dtype_is_a_no_op_on_one_device(dtype):
    # 1 + 2**-12 rounds to 1 in both low-precision dtypes.
    grad = [1.0 + 2.0**-12, 3.0]
    updates = {}
    for all_reduce_dtype in (None, dtype):
        var, _, step = _stepper("function", initial_scale=1.0, all_reduce_dtype=all_reduce_dtype)
        step(grad)
        updates[all_reduce_dtype] = var.numpy().tolist()
    assert updates[dtype] == updates[None] == [1 - 0.5 * g for g in np.float32(grad)]


def test_keras2_loop_under_mirrored_strategy(distributed):
    result = distributed["mirrored"]["keras2_loop"]
    np.testing.assert_allclose(result["guide"], result["keras3"], rtol=1e-6)


# --- Child process --------------------------------------------------------


def _local(strategy: tf.distribute.Strategy, variable: keras.Variable) -> list[Any]:
    return [v.numpy().tolist() for v in strategy.experimental_local_results(variable.value)]


def _apply_per_replica(
    strategy: tf.distribute.Strategy,
    make_optimizer: Callable[[], Any],
    per_replica_grads: Sequence[Sequence[Sequence[float]]],
    shapes: Sequence[tuple[int, ...]] = ((2,),),
) -> tuple[list[keras.Variable], Any]:
    """Applies per_replica_grads[step][replica][variable] to variables of ones.

    With one replica, the replicas' gradients are summed first.
    """
    with strategy.scope():
        variables = [keras.Variable(np.ones(s, np.float32), name=n) for s, n in zip(shapes, "wv")]
        opt = make_optimizer()
        opt.build(variables)

    @tf.function
    def step(grads):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply([tf.gather(g, replica) for g in grads], variables)

        strategy.run(replica_fn)

    for step_grads in per_replica_grads:
        per_variable = [
            np.array([replica[i] for replica in step_grads], np.float32) for i in range(len(shapes))
        ]
        if strategy.num_replicas_in_sync == 1:
            per_variable = [g.sum(axis=0, keepdims=True) for g in per_variable]
        step([tf.constant(g) for g in per_variable])
    return variables, opt


def _nan_on_replica(
    strategy: tf.distribute.Strategy,
    bad_replica: int,
    cls: type = LossScaleOptimizer,
) -> tuple[keras.Variable, Any]:
    grads = [[[4.0, 4.0]], [[4.0, 4.0]]]
    grads[bad_replica] = [[np.nan, 4.0]]
    (var,), opt = _apply_per_replica(
        strategy, lambda: cls(keras.optimizers.SGD(1.0), initial_scale=4.0), [grads]
    )
    return var, opt


# Two replicas whose gradients sum to a=[3, 4], b=[12] (global norm 13), all
# scaled by 8.
_CLIP_GRADS = [[[8 * 1.0, 8 * 3.0], [8 * 5.0]], [[8 * 2.0, 8 * 1.0], [8 * 7.0]]]


def _clip_update(
    strategy: tf.distribute.Strategy, clip: str, cls: type = LossScaleOptimizer
) -> list[list[float]]:
    variables, _ = _apply_per_replica(
        strategy,
        lambda: cls(keras.optimizers.SGD(1.0, **{clip: 1.0}), initial_scale=8.0),
        [_CLIP_GRADS],
        shapes=[(2,), (1,)],
    )
    local = [strategy.experimental_local_results(v.value) for v in variables]
    # Per replica: the update of every variable, flattened.
    return [np.concatenate([1 - v.numpy() for v in replica]).tolist() for replica in zip(*local)]


def _fit(
    strategy: tf.distribute.Strategy, cls: type = LossScaleOptimizer
) -> tuple[keras.Model, Any]:
    x, y = _nan_batch_data()
    with strategy.scope():
        model = _linear_model()
        opt = cls(keras.optimizers.SGD(0.1, global_clipnorm=0.5))
        model.compile(optimizer=opt, loss="mse")
    # Global batches of 4: the NaN (row 6) lands on the last replica.
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    return model, opt


def _accumulation(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    # Window 1 (finite, then NaN on the last replica) applies its first
    # micro-batch alone; window 2 the mean of two finite micro-batches.
    steps = [
        [[[2.0, 4.0]], [[2.0, 0.0]]],
        [[[2.0, 2.0]], [[np.nan, 2.0]]],
        [[[1.0, 1.0]], [[1.0, 1.0]]],
        [[[3.0, 3.0]], [[3.0, 3.0]]],
    ]
    (var,), opt = _apply_per_replica(
        strategy,
        lambda: LossScaleOptimizer(
            keras.optimizers.SGD(1.0, gradient_accumulation_steps=2),
            initial_scale=2.0,
        ),
        steps,
    )
    return {"weights": _local(strategy, var), "skipped_steps": opt.skipped_steps}


def _keras2_loop(strategy: tf.distribute.Strategy) -> dict[str, list[float]]:
    x = tf.constant(np.random.RandomState(3).normal(size=(4, 3)).astype("float32"))
    weights = {}
    for style in ("guide", "keras3"):
        with strategy.scope():
            model = _linear_model()
            opt = LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=2.0**8, growth_interval=1
            )
            # Built up front: a loss-scale optimizer (stock or ours) first
            # built inside strategy.run in a tf.function fails in TF's
            # variable-lifting cond.
            opt.build(model.trainable_variables)

        @tf.function
        def step():
            def replica_fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(model(x) ** 2) / 8.0
                    scaled_loss = opt.get_scaled_loss(loss)
                grads = tape.gradient(scaled_loss, model.trainable_variables)
                if style == "guide":
                    grads = opt.get_unscaled_gradients(grads)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            strategy.run(replica_fn)

        for _ in range(3):
            step()
        weights[style] = np.concatenate(
            [v.numpy().ravel() for v in model.trainable_variables]
        ).tolist()
    return weights


# Per replica; their sums (2 + 2**-10 + 2**-12, 3 + 2**-6, 3e-3) need float32.
_ALL_REDUCE_GRADS = [[[1.0 + 2.0**-10, 1.0, 1e-3]], [[1.0 + 2.0**-12, 2.0 + 2.0**-6, 2e-3]]]


def _all_reduce_dtype_update(strategy: tf.distribute.Strategy, dtype: str | None) -> dict[str, Any]:
    """The SGD(1) update of summed gradients, and the dtypes of the all-reduce ops."""
    with strategy.scope():
        var = keras.Variable(np.zeros(3, np.float32), name="w")
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(1.0), initial_scale=1.0, all_reduce_dtype=dtype
        )
        opt.build([var])

    @tf.function
    def step(grads):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply([tf.gather(grads, replica)], [var])

        strategy.run(replica_fn)

    grads = tf.constant([replica[0] for replica in _ALL_REDUCE_GRADS], tf.float32)
    step(grads)
    graph = step.get_concrete_function(grads).graph.as_graph_def()
    nodes = [*graph.node, *(node for f in graph.library.function for node in f.node_def)]
    return {
        "updates": [(-v.numpy()).tolist() for v in strategy.experimental_local_results(var.value)],
        "wire_dtypes": sorted(
            {tf.dtypes.as_dtype(n.attr["T"].type).name for n in nodes if "Collective" in n.op}
        ),
    }


def _all_reduce_overflow(strategy: tf.distribute.Strategy, dtype: str) -> tuple[Any, Any]:
    grads = [[[40000.0]], [[40000.0]]]
    (var,), opt = _apply_per_replica(
        strategy,
        lambda: LossScaleOptimizer(
            keras.optimizers.SGD(1.0), initial_scale=1.0, min_scale=0.5, all_reduce_dtype=dtype
        ),
        [grads],
        shapes=[(1,)],
    )
    return var, opt


def _float16_update_overflow(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """float16 variables of ones, scale 1: each replica's gradient and their sum are finite, the
    update (1 + 2 * 40000) is not, in float16; then a finite step."""
    with strategy.scope():
        var = keras.Variable(np.ones(2, np.float16), name="w", dtype="float16")
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(2.0), initial_scale=1.0, min_scale=1.0, max_scale=1.0
        )
        opt.build([var])

    @tf.function
    def step(grad):
        strategy.run(lambda: opt.apply([tf.constant(grad, tf.float16)], [var]))

    step([-20000.0, 0.125])
    weights_after_overflow = _local(strategy, var)
    step([0.125, 0.125])
    return {
        "weights_after_overflow": weights_after_overflow,
        "weights": _local(strategy, var),
        "skipped_steps": opt.skipped_steps,
        "nonfinite_counts": opt.nonfinite_counts(),
        "iterations": int(opt.iterations.numpy()),
    }


def _multi_optimizer_steps(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """Adam on `w`, SGD on `v`: a finite step, then a NaN on replica 1 only."""

    def make() -> LossScaleOptimizer:
        adam, sgd = keras.optimizers.Adam(0.1), keras.optimizers.SGD(0.5)
        selector = keras.optimizers.MultiOptimizer(lambda v: adam if v.path == "w" else sgd)
        return LossScaleOptimizer(selector, initial_scale=4.0)

    finite = [[[4.0, 8.0], [4.0, 4.0]], [[4.0, 0.0], [0.0, 4.0]]]
    nan = [[[4.0, 4.0], [4.0, 4.0]], [[np.nan, 4.0], [4.0, 4.0]]]
    variables, opt = _apply_per_replica(strategy, make, [finite, nan], shapes=((2,), (2,)))
    return {
        "weights": [_local(strategy, v) for v in variables],
        "scale": _local(strategy, opt.dynamic_scale),
        "skipped_steps": opt.skipped_steps,
        "iterations": [
            int(o.iterations.numpy())
            for o in [opt.inner_optimizer, *opt.inner_optimizer.optimizers]
        ],
    }


def _batch_norm_fit(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """Batches of 4 over 2 replicas; the second one's NaN lands on the last replica."""
    x, y = _nan_batch_data()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization()]
        )
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, np.repeat(y, 2, axis=1), batch_size=4, shuffle=False, verbose=0)
    norm = model.layers[1]
    return {
        "bad_batches": opt.bad_batches,
        "finite": [
            bool(np.isfinite(replica_value).all())
            for variable in (norm.moving_mean, norm.moving_variance)
            for replica_value in _local(strategy, variable)
        ],
    }


def _per_example_loss_steps(
    strategy: tf.distribute.Strategy | None, mode: str = "function"
) -> dict[str, Any]:
    """A custom loop that hands per-example losses to the tape: a finite step, then a NaN label.

    Two examples per replica (four on one device); the loss of the first step
    is 0 + 1 per pair of examples, summed over the replicas.
    """
    strategy = strategy or tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    x = tf.constant([[1.0, 0.0], [0.0, 1.0]] * (2 // replicas))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)]
        )
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
        opt.build(model.trainable_variables)

    def replica_step(labels: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x)[:, 0] - labels)  # Shape (batch,), not reduced.
            scaled = opt.get_scaled_loss(per_example)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    def step(labels: tf.Tensor) -> None:
        strategy.run(replica_step, args=(labels,))

    if mode == "function":
        step = tf.function(step)
    step(tf.constant([1.0, 0.0] * (2 // replicas)))
    finite_loss = opt.last_loss
    step(tf.constant([np.nan, 0.0] * (2 // replicas)))
    return {
        "finite_loss": finite_loss,
        "last_loss": opt.last_loss,
        "weights": _local(strategy, model.trainable_variables[0]),
        "health": [opt.skipped_steps, opt.bad_batches, opt.bad_batch_steps(), opt.loss_scale],
    }


def _distributed_results() -> dict[str, Any]:
    """Runs the tf.distribute scenarios; needs two logical CPU devices."""
    devices = ["/cpu:0", "/cpu:1"]
    strategies = {
        "mirrored": tf.distribute.MirroredStrategy(devices),
        # Collective all-reduce (the MultiWorkerMirroredStrategy code path)
        # over two local devices of a single worker.
        "multi_worker": tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(devices),
    }
    results: dict[str, Any] = {}
    for name, strategy in strategies.items():
        results[name] = {
            "accumulation": _accumulation(strategy),
            "float16_update_overflow": _float16_update_overflow(strategy),
            "multi_optimizer": _multi_optimizer_steps(strategy),
        }
        for bad_replica in (0, 1):
            var, opt = _nan_on_replica(strategy, bad_replica)
            results[name][f"nan_on_replica_{bad_replica}"] = {
                "weights": _local(strategy, var),
                "scale": _local(strategy, opt.dynamic_scale),
                "skipped_steps": opt.skipped_steps,
                "nonfinite_counts": opt.nonfinite_counts(),
                "iterations": int(opt.iterations.numpy()),
            }
        for clip in ("clipnorm", "global_clipnorm", "clipvalue"):
            results[name][f"clip_{clip}"] = _clip_update(strategy, clip)
        for dtype in (None, "float32", "bfloat16", "float16"):
            results[name][f"all_reduce_{dtype}"] = _all_reduce_dtype_update(strategy, dtype)
        var, opt = _all_reduce_overflow(strategy, "float16")
        results[name]["all_reduce_float16_overflow"] = {
            "weights": _local(strategy, var),
            "scale": _local(strategy, opt.dynamic_scale),
            "skipped_steps": opt.skipped_steps,
        }
        var, _ = _all_reduce_overflow(strategy, "float32")
        results[name]["all_reduce_float32_no_overflow"] = _local(strategy, var)

    mirrored = strategies["mirrored"]
    # fit under one strategy only: a second strategy's collectives in the same
    # process would reuse its keys (see distribute.make_strategy).
    results["mirrored"]["batch_norm_fit"] = _batch_norm_fit(mirrored)
    var, opt = _nan_on_replica(mirrored, 1, cls=StockLossScaleOptimizer)
    results["mirrored"]["stock_nan_on_replica_1"] = {
        "finite_weights": bool(np.isfinite(var.numpy()).all()),
        "scale": _local(mirrored, opt.dynamic_scale),
    }
    stock_update = _clip_update(mirrored, "global_clipnorm", cls=StockLossScaleOptimizer)[0]
    results["mirrored"]["stock_clip_global_clipnorm"] = float(np.linalg.norm(stock_update))
    model, opt = _fit(mirrored)
    results["mirrored"]["fit"] = {
        "weights": [v.numpy().tolist() for v in model.trainable_variables],
        "replica_weights_equal": all(
            np.array_equal(*(c.numpy() for c in mirrored.experimental_local_results(v.value)))
            for v in model.trainable_variables
        ),
        "skipped_steps": opt.skipped_steps,
        "iterations": int(opt.iterations.numpy()),
    }
    model, _ = _fit(mirrored, cls=StockLossScaleOptimizer)
    results["mirrored"]["stock_fit_finite_weights"] = all(
        np.isfinite(v.numpy()).all() for v in model.trainable_variables
    )
    results["mirrored"]["keras2_loop"] = _keras2_loop(mirrored)
    results["mirrored"]["per_example_loss"] = _per_example_loss_steps(mirrored)

    single = tf.distribute.get_strategy()
    model, opt = _fit(single)
    results["single_device"] = {
        "fit": {
            "weights": [v.numpy().tolist() for v in model.trainable_variables],
            "skipped_steps": opt.skipped_steps,
            "iterations": int(opt.iterations.numpy()),
        },
        "accumulation": _accumulation(single),
        **{
            f"clip_{clip}": _clip_update(single, clip)[0]
            for clip in ("clipnorm", "global_clipnorm", "clipvalue")
        },
    }
    return results


# Drop-in for Keras 3.15's LossScaleOptimizer: its arguments and config keys -----------


def test_dynamic_growth_steps_is_keras_name_for_the_growth_interval():
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=7)
    assert ours.growth_interval == ours.dynamic_growth_steps == 7
    same = LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=7, dynamic_growth_steps=7)
    assert same.growth_interval == 7
    assert LossScaleOptimizer(keras.optimizers.SGD(0.1)).growth_interval == 2000


def test_growth_interval_and_dynamic_growth_steps_that_differ_are_one_line():
    with pytest.raises(ValueError) as raised:
        LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=3, dynamic_growth_steps=5)
    assert str(raised.value) == (
        "growth_interval and dynamic_growth_steps are one setting (Keras' name for it) and "
        "differ. Received: growth_interval=3, dynamic_growth_steps=5; give one of them"
    )


def test_a_config_of_the_stock_class_makes_ours_with_the_same_settings():
    stock = StockLossScaleOptimizer(
        keras.optimizers.AdamW(0.01, weight_decay=0.1),
        initial_scale=64.0,
        dynamic_growth_steps=5,
        name="from_stock",
    )
    ours = LossScaleOptimizer.from_config(stock.get_config())
    assert type(ours) is LossScaleOptimizer
    assert (ours.initial_scale, ours.growth_interval, ours.name) == (64.0, 5, "from_stock")
    assert type(ours.inner_optimizer) is keras.optimizers.AdamW
    assert ours.inner_optimizer.weight_decay == 0.1


def test_every_stock_config_key_is_in_ours_with_the_same_value():
    inner = keras.optimizers.SGD(0.1)
    stock = StockLossScaleOptimizer(inner, initial_scale=64.0, dynamic_growth_steps=5, name="lso")
    ours = LossScaleOptimizer(inner, initial_scale=64.0, dynamic_growth_steps=5, name="lso")
    stock_config, our_config = stock.get_config(), ours.get_config()
    assert {key: our_config[key] for key in stock_config} == stock_config
    assert LossScaleOptimizer.from_config(copy.deepcopy(our_config)).get_config() == our_config


def test_get_scaled_loss_takes_a_callable_as_tf_keras_does():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    losses = iter([2.0, 3.0])
    scaled = optimizer.get_scaled_loss(lambda: tf.constant(next(losses)))
    assert callable(scaled)
    assert (float(scaled()), float(scaled())) == (16.0, 24.0)
    assert float(optimizer.get_scaled_loss(tf.constant(0.5))) == 4.0


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_per_example_loss_is_scaled_whole_and_recorded_as_its_sum(mode):
    """Stock Keras and tf-keras scale a loss of any shape; a custom loop often gives one."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    scaled = opt.scale_loss(tf.constant([[1.0, 2.0], [3.0, 0.5]]))
    np.testing.assert_array_equal(scaled, [[8.0, 16.0], [24.0, 4.0]])
    result = _per_example_loss_steps(None, mode)
    # Each x row picks one weight: errors 0 and 1, twice; SGD(0.1) on the
    # unscaled gradient of the sum moves the second weight by 0.1 * 2 * 2.
    assert result["finite_loss"] == 2.0
    np.testing.assert_allclose(result["weights"], [[[1.0], [0.6]]], rtol=1e-6)
    # The NaN label: a bad batch, skipped, the scale and the recorded loss kept.
    assert result["last_loss"] == 2.0
    assert result["health"] == [1, 1, [2], 4.0]


def test_a_per_example_loss_under_a_strategy_is_judged_by_every_replica(distributed):
    result = distributed["mirrored"]["per_example_loss"]
    assert result["finite_loss"] == 2.0  # Each replica's sum, summed.
    assert result["last_loss"] == 2.0
    # Each replica's gradient of its own sum, all-reduced.
    np.testing.assert_allclose(result["weights"], [[[1.0], [0.6]]] * 2, rtol=1e-6)
    assert result["health"] == [1, 1, [2], 4.0]


def test_get_unscaled_gradients_keeps_each_gradients_dtype_form_and_none():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)
    sparse = tf.IndexedSlices(
        tf.constant([[2048.0, 4096.0]], tf.float16), tf.constant([1]), tf.constant([3, 2])
    )
    dense16, missing, dense32, unscaled_sparse = optimizer.get_unscaled_gradients(
        [tf.constant([3.0, 1.0], tf.float16), None, tf.constant([512.0]), sparse]
    )
    assert (dense16.dtype, dense16.numpy().tolist()) == (tf.float16, [3.0 / 1024, 1.0 / 1024])
    assert missing is None
    assert (dense32.dtype, dense32.numpy().tolist()) == (tf.float32, [0.5])
    assert isinstance(unscaled_sparse, tf.IndexedSlices)
    assert unscaled_sparse.values.dtype == tf.float16
    assert unscaled_sparse.values.numpy().tolist() == [[2.0, 4.0]]
    assert unscaled_sparse.indices.numpy().tolist() == [1]


# --- Delegation to the inner optimizer's apply() ----------------------------


def _two_groups() -> tuple[keras.Variable, keras.Variable]:
    with keras.name_scope("encoder"):
        encoder = keras.Variable(np.ones(2, np.float32), name="kernel")
    with keras.name_scope("head"):
        head = keras.Variable(np.ones(2, np.float32), name="kernel")
    return encoder, head


def _multi_optimizer() -> keras.optimizers.MultiOptimizer:
    return keras.optimizers.MultiOptimizer(
        lambda variable: adam if "encoder" in variable.path else sgd
    )


def test_multi_optimizer_with_two_groups_applies_each_and_skips_both():
    global adam, sgd
    grads = [[1.0, 2.0], [3.0, -1.0]]
    adam, sgd = keras.optimizers.Adam(0.1), keras.optimizers.SGD(0.5)
    reference_vars = _two_groups()
    reference = _multi_optimizer()
    reference.apply([tf.constant(g) for g in grads], reference_vars)

    adam, sgd = keras.optimizers.Adam(0.1), keras.optimizers.SGD(0.5)
    variables = _two_groups()
    opt = LossScaleOptimizer(_multi_optimizer(), initial_scale=2.0**10)
    apply = tf.function(lambda g: opt.apply(g, variables))
    apply([tf.constant(np.multiply(g, 2.0**10), tf.float32) for g in grads])
    for got, want in zip(variables, reference_vars):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    after_first = [v.numpy().copy() for v in variables]
    apply([tf.constant([np.inf, 1.0]), tf.constant([1.0, 1.0])])  # float16 overflow, say.
    for got, want in zip(variables, after_first):
        np.testing.assert_array_equal(got.numpy(), want)
    assert opt.loss_scale == 2.0**9 and opt.skipped_steps == 1
    # The skipped step still counts, in each optimizer that has variables.
    assert [int(o.iterations) for o in (opt.inner_optimizer, adam, sgd)] == [2, 2, 2]


def test_an_inner_optimizer_that_overrides_apply_has_it_run():
    class Halving(keras.optimizers.SGD):
        calls = 0

        def apply(self, grads, trainable_variables=None):
            Halving.calls += 1
            super().apply([g / 2 for g in grads], trainable_variables)

    var, opt, step = _stepper("function", inner=Halving(1.0), initial_scale=4.0)
    step(_scaled([2.0, 4.0], opt))
    np.testing.assert_allclose(var.numpy(), [0.0, -1.0])
    assert Halving.calls == 1  # Traced once; the skipped step below never calls it.
    step(NAN)
    np.testing.assert_allclose(var.numpy(), [0.0, -1.0])


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: keras.optimizers.AdamW(0.1, weight_decay=0.3),
        lambda: keras.optimizers.SGD(
            0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
        ),
        lambda: keras.optimizers.Adam(0.1, gradient_accumulation_steps=2),
        lambda: keras.optimizers.SGD(0.5, loss_scale_factor=8.0),
        lambda: keras.optimizers.Lion(0.1, global_clipnorm=1.0),
    ],
    ids=["weight_decay", "ema", "accumulation", "loss_scale_factor", "lion_global_clipnorm"],
)
def test_matches_the_unscaled_inner_optimizer_step_for_step(make_inner):
    grads = [[3.0, 4.0], [-1.0, 0.5], [2.0, -2.0], [0.5, 0.25]]
    reference_inner = make_inner()
    reference_var = keras.Variable(np.ones(2, np.float32), name="w")
    reference_inner.build([reference_var])
    factor = reference_inner.loss_scale_factor or 1.0
    var, opt, step = _stepper(
        "function", inner=make_inner(), initial_scale=1024.0, growth_interval=3
    )
    for grad in grads:
        # Keras' own step: the loss times loss_scale_factor, divided in apply;
        # ours takes the factor over: the loss times the loss scale alone.
        reference_inner.apply([tf.constant(np.multiply(grad, factor), tf.float32)], [reference_var])
        step(_scaled(grad, opt))
        np.testing.assert_allclose(var.numpy(), reference_var.numpy(), rtol=1e-6)
    assert int(opt.iterations) == int(reference_inner.iterations)


def test_constraints_apply_as_without_loss_scaling():
    layer = keras.layers.Dense(2, use_bias=False, kernel_constraint=keras.constraints.NonNeg())
    layer.build((1,))
    layer.kernel.assign([[1.0, 1.0]])
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0)
    opt.build([layer.kernel])
    opt.apply([tf.constant([[8.0, -4.0]])], [layer.kernel])
    np.testing.assert_allclose(layer.kernel.numpy(), [[0.0, 2.0]])


def test_a_float16_variable_update_that_overflows_is_undone_and_counted():
    """float16 variables, scale 1, an embedding gradient with duplicated indices."""
    keras.mixed_precision.set_global_policy("float16")
    embedding = keras.layers.Embedding(4, 2)
    embedding.build((None,))
    table = embedding.embeddings
    assert table.dtype == "float16"
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1.0, min_scale=1.0)
    opt.build([table])
    before = table.numpy().copy()
    # Each slice is finite in float16; the four added to row 0 are not.
    sparse = tf.IndexedSlices(
        tf.constant([[-60000.0, 1.0]] * 4, tf.float16),
        tf.constant([0, 0, 0, 0]),
        tf.constant([4, 2]),
    )
    apply = tf.function(lambda g: opt.apply([g], [table]))
    apply(sparse)
    np.testing.assert_array_equal(table.numpy(), before)
    health = opt.health()
    assert (health.skipped_steps, health.loss_scale) == (1, 1.0)
    assert health.nonfinite_counts == {table.path: 1}
    assert int(opt.iterations) == 1
    apply(
        tf.IndexedSlices(
            tf.constant([[1.0, 1.0]], tf.float16), tf.constant([1]), tf.constant([4, 2])
        )
    )
    np.testing.assert_allclose(table.numpy()[1], before[1] - 1.0, rtol=1e-3)
    assert opt.skipped_steps == 1


def test_health_reads_the_state_in_one_record():
    var, opt, step = _stepper("function", initial_scale=8.0)
    step(_scaled([3.0, 4.0], opt))
    step(NAN)
    health = opt.health()
    assert health.loss_scale == 4.0 and health.skipped_steps == 1
    assert health.bad_batches == 0 and health.bad_batch_steps == ()
    assert not health.last_step_finite
    assert health.nonfinite_counts == {"w": 1}


def test_a_batch_of_ragged_sparse_and_integer_tensors_is_judged_on_its_float_values():
    var, opt, _ = _stepper("function", initial_scale=4.0)
    ragged = tf.ragged.constant([[1.0, np.nan], [2.0]])
    sparse = tf.sparse.from_dense(tf.constant([[0.0, np.inf]]))

    @tf.function
    def step(batch):
        return opt.apply([tf.constant([4.0, 4.0])], [var], batch=batch)

    assert not bool(step((tf.constant([1, 2]), tf.ragged.constant([[1.0], [2.0, 3.0]]))))
    assert bool(step((tf.constant([1, 2]), ragged)))
    assert bool(step({"ids": tf.constant([3]), "weights": sparse}))
    assert (opt.bad_batches, opt.skipped_steps, opt.loss_scale) == (2, 2, 4.0)
    np.testing.assert_allclose(var.numpy(), [0.5, 0.5])  # One applied SGD(0.5) step of 1.


def _batch_norm_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization()]
    )


# With a plain compile: tests/any_backend/test_loss_scaling.py, on both backends.
@pytest.mark.parametrize("compile_with", ["compile_model", "compile_model_jit"])
def test_a_skipped_bad_batch_leaves_the_batch_norm_statistics_as_they_were(compile_with):
    """The forward pass updates them before the verdict; a skipped step puts them back."""
    from mpt_keras.execution import xla

    rng = np.random.RandomState(4)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    bad_x = x.copy()
    bad_x[2, 1] = np.nan  # In the first of two batches of 8.
    statistics = []
    for features, batches in ((bad_x, slice(0, 16)), (x, slice(8, 16))):
        model = _batch_norm_model()
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        xla.compile_model(
            model, optimizer=opt, loss="mse", jit_compile=compile_with.endswith("jit")
        )
        model.fit(features[batches], y[batches], batch_size=8, shuffle=False, verbose=0)
        norm = model.layers[1]
        statistics.append([norm.moving_mean.numpy(), norm.moving_variance.numpy()])
    assert opt.bad_batches == 0  # The reference saw the good batch only.
    for with_bad, good_only in zip(*statistics):
        np.testing.assert_allclose(with_bad, good_only, rtol=1e-6)
        assert np.isfinite(with_bad).all()


def test_hand_overs_no_apply_took_are_dropped_when_another_graph_hands_over():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    for _ in range(3):  # A new graph each: scale_loss without apply.
        tf.function(lambda: opt.scale_loss(tf.constant(1.0))).get_concrete_function()
    assert len(opt._handed_over) == 1

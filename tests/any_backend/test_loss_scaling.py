"""LossScaleOptimizer's exact trajectories, run alike on Keras' TensorFlow and JAX backends.

The main pytest process runs this file on TensorFlow; `tests/test_jax_backend.py` runs it again
in a process with `KERAS_BACKEND=jax` where TensorFlow cannot be imported. Written in
`keras.ops` only; the one backend-specific piece is `_traced`, the compiled step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import pytest
from keras import ops

from mpt_keras.scaling.optimizer import LossScaleOptimizer

FINITE = [1.0, 2.0]
NAN = [np.nan, 2.0]
INF = [np.inf, 2.0]
MODES = ["eager", "compiled"]
BACKEND = keras.backend.backend()


def _traced(opt: LossScaleOptimizer, variables: list[keras.Variable]) -> Callable[..., None]:
    """`opt.apply(grads, variables)` compiled: XLA on TensorFlow, `jax.jit` of
    `stateless_apply` (as Keras' JAX trainer calls it) on JAX."""
    if BACKEND == "jax":
        import jax

        step = jax.jit(opt.stateless_apply)

        def apply(grads: Sequence[Any]) -> None:
            trainable, optimizer = step(
                [v.value for v in opt.variables], list(grads), [v.value for v in variables]
            )
            for variable, value in zip([*variables, *opt.variables], [*trainable, *optimizer]):
                variable.assign(value)

        return apply
    import tensorflow as tf

    return tf.function(lambda grads: opt.apply(grads, variables), jit_compile=True)


def _stepper(
    mode: str, inner: keras.optimizers.Optimizer | None = None, **kwargs: Any
) -> tuple[keras.Variable, LossScaleOptimizer, Callable[[Sequence[float]], None]]:
    """A built optimizer on one variable of ones and a step(grad) function."""
    var = keras.Variable(np.ones((2,), np.float32), name="w")
    opt = LossScaleOptimizer(inner or keras.optimizers.SGD(0.5), **kwargs)
    opt.build([var])
    if mode == "eager":
        apply = lambda grads: opt.apply(grads, [var])  # noqa: E731
    else:
        apply = _traced(opt, [var])
    return var, opt, lambda grad: apply([ops.convert_to_tensor(np.float32(grad))])


def _scaled(grad: Sequence[float], opt: LossScaleOptimizer) -> np.ndarray:
    """`grad` as the optimizer receives it from a loss scaled by its scale."""
    return np.multiply(grad, opt.loss_scale)


TRAJECTORIES = [
    pytest.param(
        dict(initial_scale=2.0, growth_interval=2),
        [FINITE] * 8,
        [2, 4, 4, 8, 8, 16, 16, 32],
        id="growth_interval_2",
    ),
    pytest.param(dict(initial_scale=400.0), [INF, NAN, INF, NAN], [200, 100, 50, 25], id="backoff"),
    pytest.param(
        dict(initial_scale=8.0, growth_interval=2),
        [FINITE, INF, FINITE, FINITE],
        [8, 4, 4, 8],
        id="overflow_restarts_growth_count",
    ),
    pytest.param(
        dict(initial_scale=16.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1),
        [FINITE, INF, INF],
        [48, 12, 3],
        id="custom_factors",
    ),
    pytest.param(dict(initial_scale=64.0, hysteresis=1), [INF] * 4, [32, 16, 8, 4], id="hyst_1"),
    pytest.param(dict(initial_scale=64.0, hysteresis=3), [INF] * 4, [64, 64, 32, 16], id="hyst_3"),
    pytest.param(
        # A finite step does not restore the hysteresis budget; a growth does.
        dict(initial_scale=64.0, hysteresis=2, growth_interval=2),
        [INF, FINITE, INF, FINITE, FINITE, INF, INF],
        [64, 64, 32, 32, 64, 64, 32],
        id="hysteresis_restored_by_growth",
    ),
    pytest.param(dict(initial_scale=4.0), [INF] * 4, [2, 1, 1, 1], id="floor"),
    pytest.param(
        dict(initial_scale=2.0**22, growth_interval=1),
        [FINITE] * 4,
        [2.0**23, 2.0**24, 2.0**24, 2.0**24],
        id="ceiling",
    ),
    pytest.param(
        dict(initial_scale=1.0, dynamic=False, growth_interval=1),
        [FINITE, NAN, FINITE, INF],
        [1, 1, 1, 1],
        id="static",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kwargs", "steps", "expected"), TRAJECTORIES)
def test_scale_trajectory_and_skips(mode, kwargs, steps, expected):
    var, opt, step = _stepper(mode, **kwargs)
    trajectory = []
    for grad in steps:
        step(_scaled(grad, opt))
        trajectory.append(opt.loss_scale)
    assert trajectory == expected
    finite_steps = sum(np.isfinite(g).all() for g in steps)
    assert opt.skipped_steps == len(steps) - finite_steps
    assert int(opt.iterations) == len(steps)
    # Only finite steps moved the weights: SGD(0.5) on the unscaled FINITE.
    np.testing.assert_allclose(var.numpy(), 1 - 0.5 * finite_steps * np.array(FINITE), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_skipped_step_leaves_weights_and_adam_slots(mode, bad):
    var, opt, step = _stepper(mode, inner=keras.optimizers.Adam(0.1), initial_scale=8.0)
    step(_scaled(FINITE, opt))
    inner = opt.inner_optimizer
    slots = {v.path: v.numpy().copy() for v in inner.variables if "iteration" not in v.path}
    weights = var.numpy().copy()
    step(bad)
    np.testing.assert_array_equal(var.numpy(), weights)
    for v in inner.variables:
        if v.path in slots:
            np.testing.assert_array_equal(v.numpy(), slots[v.path], err_msg=v.path)
    assert int(opt.iterations) == int(inner.iterations) == 2
    assert opt.skipped_steps == 1
    health = opt.health()
    assert (health.loss_scale, health.skipped_steps, health.bad_batches) == (4.0, 1, 0)
    assert health.nonfinite_counts == {"w": 1} and not health.last_step_finite


def test_learning_rate_schedule_sees_skipped_steps():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.1])
    var, opt, step = _stepper("compiled", inner=keras.optimizers.SGD(schedule), initial_scale=1.0)
    for grad in [FINITE, NAN, FINITE]:
        step(_scaled(grad, opt))
    np.testing.assert_allclose(var.numpy(), [-0.1, -1.2], rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_counts_attribute_steps_to_variables(mode):
    a = keras.Variable(np.ones(2, np.float32), name="a")
    b = keras.Variable(np.ones(3, np.float32), name="b")
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0)
    opt.build([a, b])
    apply = _traced(opt, [a, b]) if mode == "compiled" else lambda g: opt.apply(g, [a, b])
    for ga, gb in [
        (NAN, [1, 1, 1]),
        ([1, 1], [1, np.inf, 1]),
        ([1, 1], [np.nan] * 3),
        ([1, 1], [1, 1, 1]),
    ]:
        apply([ops.convert_to_tensor(np.float32(ga)), ops.convert_to_tensor(np.float32(gb))])
    assert opt.nonfinite_counts() == {"a": 1, "b": 2}
    assert opt.skipped_steps == 3
    np.testing.assert_allclose(a.numpy(), [0.9, 0.9], rtol=1e-6)


@pytest.mark.parametrize(
    ("element", "skipped"),
    # 1e19**2 = 1e38 is a float32; 2e19**2 = 4e38 is not (Adam's second moment would be inf).
    [(1e19, 0), (2e19, 1)],
    ids=["norm_1e19_applied", "norm_2e19_skipped"],
)
def test_gradient_whose_squared_norm_overflows_float32_is_skipped(element, skipped):
    var, opt, step = _stepper("compiled", inner=keras.optimizers.Adam(0.1), initial_scale=1.0)
    step([element, 0.0])
    assert opt.skipped_steps == skipped
    assert opt.nonfinite_counts() == {"w": skipped}
    assert all(np.isfinite(v.numpy()).all() for v in opt.inner_optimizer.variables)


def _fixed_weights(model: keras.Model, seed: int = 0) -> keras.Model:
    """The same weights on every backend (Keras' seeded initializers differ between them)."""
    rng = np.random.RandomState(seed)
    model.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in model.get_weights()])
    return model


def _linear_model() -> keras.Model:
    return _fixed_weights(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))


def test_gradient_accumulation_drops_nonfinite_micro_batches():
    """Windows of 2 micro-batches (A, B), (NaN, D), (NaN, NaN) update as Adam on A+B, then D."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    nan_x = np.full((4, 3), np.nan, np.float32)
    stream_x = np.concatenate([x[0:8], nan_x, x[12:16], nan_x, nan_x])
    stream_y = np.concatenate([y[0:8], y[8:12], y[12:16], y[0:8]])

    reference = _linear_model()
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    reference.fit(x[0:8], y[0:8], batch_size=8, shuffle=False, verbose=0)
    reference.fit(x[12:16], y[12:16], batch_size=4, shuffle=False, verbose=0)

    model = _linear_model()
    inner = keras.optimizers.Adam(0.05, gradient_accumulation_steps=2)
    opt = LossScaleOptimizer(inner, initial_scale=2.0**10, growth_interval=100)
    model.compile(optimizer=opt, loss="mse")
    model.fit(stream_x, stream_y, batch_size=4, shuffle=False, verbose=0)
    for got, want in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert (opt.skipped_steps, opt.bad_batches) == (3, 3)
    assert opt.health().bad_batch_steps == (3, 5, 6)  # Micro-batches, counted from 1.
    # Iterations count windows (updates), as with Keras' own accumulation.
    assert int(opt.iterations) == int(inner.iterations) == 3
    assert opt.loss_scale == 2.0**10


def _nan_batch_data() -> tuple[np.ndarray, np.ndarray]:
    """Three batches of 4; the second one has a NaN input."""
    rng = np.random.RandomState(2)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    x[6, 1] = np.nan
    return x, y


def test_fit_takes_a_nan_batch_for_bad_data_not_an_overflow():
    """The train step hands the optimizer the batch: enough to tell, compiled or not."""
    x, y = _nan_batch_data()
    weights = {}
    for jit_compile in (True, False):
        model = _linear_model()
        opt = LossScaleOptimizer(keras.optimizers.Adam(0.01))
        model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
        assert model.jit_compile is jit_compile
        history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        assert opt.skipped_steps == opt.bad_batches == 1
        assert opt.health().bad_batch_steps == (2,)
        assert int(opt.iterations) == 3
        assert opt.loss_scale == 2.0**15  # Left alone.
        assert opt.nonfinite_counts() == {v.path: 0 for v in model.trainable_variables}
        assert history.history["skipped_steps"] == [1.0]
        assert history.history["loss_scale"] == [2.0**15]
        weights[jit_compile] = [v.numpy() for v in model.trainable_variables]
        assert all(np.isfinite(w).all() for w in weights[jit_compile])
    for jit, plain in zip(weights[True], weights[False]):
        np.testing.assert_allclose(jit, plain, rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_mixed_float16_compile_wraps_in_ours_which_backs_off_then_applies(jit_compile):
    """At the default scale 2**15 the first float16 gradient overflows (skipped, scale
    halved); the second applies. The same numbers on both backends."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.RandomState(5)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model = _linear_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    opt = model.optimizer
    assert isinstance(opt, LossScaleOptimizer)
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0).history
    assert (history["loss_scale"], history["skipped_steps"]) == ([2.0**14], [1.0])
    # XLA on TensorFlow rounds one float16 step a little differently (4.110538).
    np.testing.assert_allclose(history["gradient_norm"], [4.110267], rtol=1e-4)
    # TensorFlow's oneDNN kernels compute float16 natively on a CPU with AVX512_FP16: 5.379128.
    np.testing.assert_allclose(history["loss"], [5.378579], rtol=2e-4)
    assert (opt.skipped_steps, opt.bad_batches, int(opt.iterations)) == (1, 0, 2)
    assert opt.nonfinite_counts() == {v.path: 1 for v in model.trainable_variables}


def test_a_skipped_bad_batch_leaves_the_batch_norm_statistics_as_they_were():
    """The forward pass updates them before the verdict; a skipped step puts them back."""
    rng = np.random.RandomState(4)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    bad_x = x.copy()
    bad_x[2, 1] = np.nan  # In the first of two batches of 8.
    statistics = []
    for features, batches in ((bad_x, slice(0, 16)), (x, slice(8, 16))):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization()]
        )
        _fixed_weights(model)
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
        model.fit(features[batches], y[batches], batch_size=8, shuffle=False, verbose=0)
        norm = model.layers[1]
        statistics.append([norm.moving_mean.numpy(), norm.moving_variance.numpy()])
    assert opt.bad_batches == 0  # The reference saw the good batch only.
    for with_bad, good_only in zip(*statistics):
        np.testing.assert_allclose(with_bad, good_only, rtol=1e-6)
        assert np.isfinite(with_bad).all()


def test_a_float8_model_keeps_its_scale_state_out_of_the_unscaling():
    """Float8 scales get their new value as a "gradient": the loss scale must not divide it.
    The forward scales come out alike at loss scales 1 and 2**12; the gradient's scale, of
    the scaled gradient, 2**12 times larger. The same numbers on both backends."""
    rng = np.random.RandomState(1)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    scales = []
    for loss_scale in (1.0, 2.0**12):
        model = _fixed_weights(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]))
        model.quantize("float8")
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=loss_scale)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        assert opt.skipped_steps == 0
        scales.append(
            {
                v.path.rpartition("/")[2]: float(v.numpy())
                for v in model.weights
                if v.path.endswith("_scale")
            }
        )
    for scale in scales:
        np.testing.assert_allclose(scale["inputs_scale"], 0.00513736, rtol=1e-5)
        np.testing.assert_allclose(scale["kernel_scale"], 0.00569864, rtol=1e-5)
    np.testing.assert_allclose(scales[0]["outputs_grad_scale"], 2.3850482e-05, rtol=1e-5)
    ratio = scales[1]["outputs_grad_scale"] / scales[0]["outputs_grad_scale"]
    np.testing.assert_allclose(ratio, 2.0**12, rtol=1e-5)


def test_get_config_round_trips():
    opt = LossScaleOptimizer(
        keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
        initial_scale=8.0,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=3,
        hysteresis=2,
        min_scale=2.0,
        max_scale=1024.0,
    )
    again = LossScaleOptimizer.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert (again.hysteresis, again.min_scale, again.max_scale) == (2, 2.0, 1024.0)


def test_a_saved_model_loads_with_our_optimizer_and_its_state(tmp_path):
    x, y = _nan_batch_data()
    model = _linear_model()
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, LossScaleOptimizer)
    assert (opt.skipped_steps, opt.bad_batches, int(opt.iterations)) == (1, 1, 3)
    loaded_health, health = opt.health(), model.optimizer.health()
    # Keras names the loaded variables without the model's name.
    assert list(loaded_health.nonfinite_counts.values()) == list(health.nonfinite_counts.values())
    assert dataclasses.replace(loaded_health, nonfinite_counts={}) == dataclasses.replace(
        health, nonfinite_counts={}
    )
    loaded.fit(x[:4], y[:4], batch_size=4, verbose=0)  # Trains on, from the loaded state.
    assert int(opt.iterations) == 4 and opt.skipped_steps == 1


def test_unscaled_gradients_of_a_float8_model_are_refused_in_one_line():
    """get_unscaled_gradients would divide the float8 state's new values by the scale too."""
    from mpt_keras.errors import UserInputError

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.quantize("float8")
    variables = model.trainable_variables
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=8.0)
    opt.build(variables)
    grads = opt.get_unscaled_gradients([ops.zeros(v.shape, v.dtype) for v in variables])
    with pytest.raises(UserInputError, match="is a float8 layer's state, and the gradients"):
        opt.apply(grads, variables)

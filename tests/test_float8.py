"""Tests for mpt_keras.precision.float8 and float8 state under the LossScaleOptimizer.

The models are tiny: a float8 `Dense` and a float8 `EinsumDense` between a
float32 input and a float32 output layer. Keras' float8 layers train only in
a compiled function (see the module docstring), so the steps run in Keras'
own train step (`model.compile`) or ours with XLA (`xla.compile_model`).
Written for Keras 3.15.1.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from replicas import on_two_cpus, run_on_two_cpus, two_cpu_strategy
from tiny_runs import Crash, CrashAtStep, manifest_file, tiny_config

from mpt_keras.backend.tensorflow.checkpoints import Checkpointer
from mpt_keras.errors import UserInputError
from mpt_keras.execution import xla
from mpt_keras.precision.float8 import (
    FLOAT8_VARIABLE_NAMES,
    float8_shares,
    float8_statistics,
    float8_variables,
    format_max,
    to_float8,
)
from mpt_keras.precision.float8_census import take_census
from mpt_keras.runs.training import Runtime, run_training
from mpt_keras.scaling.optimizer import LossScaleOptimizer

# Its two-replica cases run in the two-CPU host (tests/replicas.py).
pytestmark = on_two_cpus

STEPS = ["keras_step", "xla"]
FLOAT8_PATHS = ["hidden", "mix"]
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(4, 4)).astype("float32")
Y = _RNG.normal(size=(4, 1)).astype("float32")


def _model(policy: str = "mixed_float16", float8: bool = True) -> keras.Model:
    """float32 input -> Dense -> EinsumDense -> float32 output, the middle two in float8."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="hidden", dtype=policy)(inputs)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=3, name="mix", dtype=policy)(x)
    outputs = keras.layers.Dense(1, name="out", dtype="float32")(x)
    model = keras.Model(inputs, outputs, name="net")
    if float8:
        to_float8(model, FLOAT8_PATHS)
    return model


def _compiled(optimizer: keras.optimizers.Optimizer, step: str, **kwargs: Any) -> keras.Model:
    model = _model(**kwargs)
    if step == "xla":
        xla.compile_model(model, optimizer=optimizer, loss="mse", jit_compile=True)
    else:
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model


def _float8_values(model: keras.Model) -> dict[str, np.ndarray]:
    return {
        f"{path}/{name}": variable.numpy()
        for path, variables in float8_variables(model).items()
        for name, variable in variables.items()
    }


def _nonfinite_gradients(model: keras.Model, scale: float) -> list[str]:
    """The variables whose gradient of the loss times `scale` holds a NaN or Inf."""

    @tf.function  # Keras' float8 layers have no eager gradient.
    def gradients():
        with tf.GradientTape() as tape:
            loss = scale * ops.mean(keras.losses.mean_squared_error(Y, model(X, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    return [
        variable.path
        for variable, gradient in zip(model.trainable_variables, gradients())
        if not np.isfinite(gradient.numpy()).all()
    ]


def _assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


# --- Turning layers to float8 ----------------------------------------------


def test_to_float8_keeps_each_layers_compute_dtype():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="a", dtype="mixed_float16")(inputs)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=3, name="b", dtype="mixed_bfloat16")(x)
    x = keras.layers.Dense(2, name="c")(x)
    model = keras.Model(inputs, x)

    assert to_float8(model, ["a", "b", "c", "a"]) == ("a", "b", "c")
    assert to_float8(model, ["a"]) == ()  # Already float8.

    layers = [model.get_layer(name) for name in "abc"]
    assert [layer.dtype_policy.name for layer in layers] == [
        "float8_from_mixed_float16",
        "float8_from_mixed_bfloat16",
        "float8_from_float32",
    ]
    assert [layer.compute_dtype for layer in layers] == ["float16", "bfloat16", "float32"]
    assert {layer.variable_dtype for layer in layers} == {"float32"}


def test_float8_variables_are_keras_own_per_layer():
    model = _model()
    variables = float8_variables(model)
    assert list(variables) == FLOAT8_PATHS
    assert FLOAT8_VARIABLE_NAMES == (
        "inputs_scale",
        "inputs_amax_history",
        "kernel_scale",
        "kernel_amax_history",
        "outputs_grad_scale",
        "outputs_grad_amax_history",
    )
    for path, by_name in variables.items():
        assert list(by_name) == list(FLOAT8_VARIABLE_NAMES)
        for name, variable in by_name.items():
            assert variable.path == f"{path}/{name}"
            assert variable.dtype == "float32"
            assert variable.trainable and variable.overwrite_with_gradient
            assert variable.shape == (() if name.endswith("_scale") else (1024,))


def test_a_layer_of_another_class_is_refused_by_path_and_class():
    class OwnDense(keras.layers.Dense):
        pass

    inputs = keras.Input((4,))
    x = keras.layers.LayerNormalization(name="norm")(inputs)
    x = OwnDense(2, name="own")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(x))
    with pytest.raises(UserInputError) as error:
        to_float8(model, ["out", "norm"])
    assert str(error.value) == (
        "layer 'norm': LayerNormalization cannot train in float8. "
        "Allowed: Dense, EinsumDense (Keras' own, not subclasses)"
    )
    with pytest.raises(UserInputError, match=r"^layer 'own': OwnDense cannot train in float8\."):
        to_float8(model, ["own"])
    assert model.get_layer("out").quantization_mode is None  # Nothing turned.


def test_an_unknown_path_is_refused_with_the_allowed_paths():
    with pytest.raises(UserInputError) as error:
        to_float8(_model(float8=False), ["hiden"])
    assert str(error.value) == (
        "layer 'hiden': model 'net' has no layer at this path. "
        "Allowed: the paths of its Dense, EinsumDense layers: hidden, mix, out"
    )


def test_to_float8_after_the_optimizer_is_built_is_refused():
    model = _compiled(keras.optimizers.SGD(0.1), "keras_step", float8=False)
    model.train_on_batch(X, Y)
    with pytest.raises(ValueError, match="its optimizer is built"):
        to_float8(model, ["hidden"])


# --- The float8 state under loss scaling -------------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_good_steps_write_what_keras_own_optimizer_writes(step):
    """Ours writes the float8 state as Keras' stock LossScaleOptimizer does, bit for bit."""
    ours = _compiled(LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10), step)
    stock = _compiled(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10),
        "keras_step",
    )
    for _ in range(3):
        ours.train_on_batch(X, Y)
        stock.train_on_batch(X, Y)
    _assert_same(_float8_values(ours), _float8_values(stock))
    # Keras' delayed scaling by hand: the history rolls, the step's amax in slot 0, ...
    history = float8_variables(ours)["hidden"]["inputs_amax_history"].numpy()
    amax = np.abs(X.astype("float16")).max()
    np.testing.assert_array_equal(history[[0, -2, -1]], [amax, amax, amax])
    assert not history[1:-2].any()
    # ... and the scale is the largest amax before the step over e4m3's largest, 448.
    scale = float8_variables(ours)["hidden"]["inputs_scale"].numpy()
    assert scale == np.float32(1) / (np.float32(448) / np.float32(amax))


@pytest.mark.parametrize("step", STEPS)
def test_a_skipped_float16_step_leaves_the_float8_state_untouched(step):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
    model = _compiled(optimizer, step)
    for _ in range(2):
        model.train_on_batch(X, Y)
    before = _float8_values(model)
    assert before["hidden/inputs_scale"] != 1.0  # Two steps changed the state.

    bad_batch = X.copy()
    bad_batch[1, 2] = np.inf
    model.train_on_batch(bad_batch, Y)
    assert (optimizer.skipped_steps, optimizer.bad_batches, optimizer.loss_scale) == (1, 1, 2.0**10)
    _assert_same(_float8_values(model), before)

    # A scale so large that the float16 output gradient overflows: Keras'
    # float8 layer clips the Inf, so only its amax history shows it.
    assert _nonfinite_gradients(model, 2.0**24) == ["mix/outputs_grad_amax_history"]
    optimizer.dynamic_scale.assign(2.0**24)
    model.train_on_batch(X, Y)
    assert (optimizer.skipped_steps, optimizer.bad_batches, optimizer.loss_scale) == (2, 1, 2.0**23)
    assert {path: n for path, n in optimizer.nonfinite_counts().items() if n} == {
        "mix/outputs_grad_amax_history": 1
    }
    _assert_same(_float8_values(model), before)


def test_an_update_that_overflows_float16_variables_leaves_the_float8_state_as_before():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(60000.0), initial_scale=2.0**10)
    model = _compiled(optimizer, "keras_step", policy="float16")
    assert model.get_layer("mix").dtype_policy.name == "float8_from_float16"
    before = _float8_values(model)
    model.train_on_batch(X, Y)
    assert optimizer.skipped_steps == 1  # The update made a float16 kernel Inf: undone.
    _assert_same(_float8_values(model), before)


def test_gradient_accumulation_takes_the_windows_amax():
    """As Keras' own accumulation: a float8 value takes the window's largest, not its mean."""
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), initial_scale=2.0**10
    )
    model = _compiled(optimizer, "keras_step")
    model.train_on_batch(X, Y)
    model.train_on_batch(X / 4, Y)
    history = float8_variables(model)["hidden"]["inputs_amax_history"].numpy()
    assert history[0] == np.abs(X.astype("float16")).max()
    assert not history[1:].any()


def test_checkpoints_restore_the_float8_state_exactly(tmp_path):
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**10)
    model = _compiled(optimizer, "keras_step")
    for _ in range(2):
        model.train_on_batch(X, Y)
    saved = _float8_values(model)
    checkpointer = Checkpointer(str(tmp_path / "run"), model, optimizer, keep=1)
    checkpointer.save(2)
    model.save(tmp_path / "model.keras")

    model.train_on_batch(X, Y)
    history = saved["hidden/inputs_amax_history"]
    assert not np.array_equal(_float8_values(model)["hidden/inputs_amax_history"], history)
    assert checkpointer.restore() == 2
    _assert_same(_float8_values(model), saved)

    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.get_layer("mix").dtype_policy.name == "float8_from_mixed_float16"
    # The same values by name; a loaded layer lists its float8 variables first.
    _assert_same(_float8_values(loaded), saved)


def test_a_crashed_float8_run_resumes_to_the_state_of_an_uninterrupted_one(tfds_dir, tmp_path):
    """mpt-train's own resume: weights, float8 scales and histories, bit for bit."""
    manifest = manifest_file(
        tmp_path / "float8.json",
        "mixed_float16",
        {"match": {"path": "dense_0"}, "policy": "float8"},
    )
    config = tiny_config(tfds_dir, steps=7, manifest=manifest)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # The straight run also exports its SavedModel: our float8 call, traced for serving.
    run_training(config.merged({"saved_model": True}), Runtime(straight, verbose=0))
    with pytest.raises(Crash):
        run_training(config, Runtime(resumed, verbose=0, callbacks=(CrashAtStep(5),)))
    keras.backend.clear_session(free_memory=False)
    assert run_training(config, Runtime(resumed, verbose=0))["step"] == 7

    models = [
        keras.saving.load_model(os.path.join(run, "model.keras")) for run in (straight, resumed)
    ]
    expected, actual = (_float8_values(model) for model in models)
    _assert_same(actual, expected)
    x = np.random.default_rng(0).uniform(0, 255, (4, 8, 8, 1)).astype("float32")
    served = tf.saved_model.load(os.path.join(straight, "saved_model"))  # Owns the variables.
    # Our GEMMs (traced for serving) against Keras' call (a loaded model.keras runs it): the
    # same float8 values, their scales multiplied after the sum, not before it, in float16.
    keras_call = models[0].predict(x, verbose=0)
    tolerance = 2.0**-10 * np.abs(keras_call).max()
    np.testing.assert_allclose(served.serve(x), keras_call, rtol=0, atol=tolerance)
    # Seven steps wrote seven amaxes, resumed at step 3's checkpoint or not.
    history = expected["dense_0/inputs_amax_history"]
    assert np.count_nonzero(history) == 7, history[:8]
    for a, b in zip(models[0].weights, models[1].weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


# --- Statistics ----------------------------------------------------------------


def test_float8_shares_of_a_hand_made_tensor():
    values = [0.0, 448.0, -500.0, 2.0**-10, 1.5 * 2.0**-10, -(2.0**-11), np.inf, np.nan]
    # e4m3 at scale 1: -500 and Inf saturate (448 is its largest value); 2**-10
    # (half its smallest, 2**-9: a tie, to even) and -2**-11 flush to zero.
    shares = float8_shares(values, "e4m3")
    assert (shares.saturated, shares.underflowed) == (0.25, 0.25)
    # At scale 2 only Inf saturates, and 1.5 * 2**-10 flushes too.
    shares = float8_shares(values, "e4m3", 2.0)
    assert (shares.saturated, shares.underflowed) == (0.125, 0.375)
    # e5m2 reaches 57344, and down to 2**-16: only Inf is lost.
    shares = float8_shares(tf.constant(values, "float16"), "e5m2")
    assert (shares.saturated, shares.underflowed) == (0.125, 0.0)
    assert (format_max("e4m3"), format_max("e5m2")) == (448.0, 57344.0)
    with pytest.raises(UserInputError) as error:
        float8_shares(values, "e4m3fn")
    assert str(error.value) == "float8 format: received 'e4m3fn'. Allowed: e4m3, e5m2"


def test_float8_statistics_read_scales_amax_and_the_kernels_losses():
    model = _model()
    hidden = float8_variables(model)["hidden"]
    hidden["inputs_scale"].assign(0.5)
    hidden["inputs_amax_history"].assign(np.r_[112.0, np.zeros(1023)])
    hidden["outputs_grad_amax_history"].assign(np.r_[57344.0 * 4, 1.0, np.zeros(1022)])
    model.get_layer("hidden").kernel.assign(np.full((4, 8), 2.0**-10) * [[1], [1], [1], [1000.0]])
    statistics = float8_statistics(model)
    assert list(statistics) == FLOAT8_PATHS
    assert statistics["hidden"].scalars() == {
        "inputs/scale": 0.5,
        "inputs/amax": 112.0,
        "inputs/range_used": 0.5,  # 112 / (448 * 0.5)
        "kernel/scale": 1.0,
        "kernel/amax": 0.0,
        "kernel/range_used": 0.0,
        "outputs_grad/scale": 1.0,
        "outputs_grad/amax": 229376.0,
        "outputs_grad/range_used": 4.0,
        "kernel/saturated": 0.0,
        "kernel/underflowed": 0.75,  # Three rows of four hold 2**-10, a tie that flushes.
    }


# --- Two replicas ------------------------------------------------------------------


def test_two_replicas_write_the_float8_state_one_device_writes():
    """The replicas agree on the largest float8 value: the global batch's amax, the scale."""
    results = run_on_two_cpus("test_float8", "_replica_results")
    one_device, two_replicas = results["one_device"], results["mirrored"]
    for name, expected in one_device.items():
        # The replicas' sums of gradients round otherwise than one device's
        # batch: the weights after a step differ in their last bits. A sum of
        # the float8 values would double them.
        np.testing.assert_allclose(two_replicas[name], expected, rtol=1e-3, err_msg=name)
    # The first layer's inputs are the data: exactly the global batch's amax
    # (Keras' stock optimizers average the replicas' amaxes).
    name = "hidden/inputs_amax_history"
    assert two_replicas[name] == one_device[name]


def _replica_results() -> dict[str, dict[str, list[float]]]:
    """One step of the float32 model on one device and under a 2-replica MirroredStrategy."""
    results = {}
    for name, strategy in (
        ("one_device", tf.distribute.get_strategy()),
        ("mirrored", two_cpu_strategy()),
    ):
        with strategy.scope():
            model = _compiled(
                LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10),
                "keras_step",
                policy="float32",
            )
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        # The scales, and each history's two slots written (0: the last step).
        results[name] = {
            key: np.ravel(value)[[0, -1]].tolist() for key, value in _float8_values(model).items()
        }
    return results


def test_keras_2_style_unscaled_gradients_with_float8_state_are_one_line():
    model = _model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.mean_squared_error(Y, model(X, training=True)))
            scaled = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(
            zip(optimizer.get_unscaled_gradients(grads), model.trainable_variables)
        )

    # Raised while tracing: autograph wraps it in its StagingError, message kept.
    with pytest.raises(Exception) as raised:
        step()
    assert (
        "UserInputError: variable 'hidden/inputs_scale' is a float8 layer's state, and the "
        "gradients passed to apply were unscaled by get_unscaled_gradients(), which divided "
        "its new value by the loss scale too. Pass the scaled gradients (of get_scaled_loss "
        "or scale_loss) to apply: it unscales all but float8 state"
    ) in str(raised.value)


def test_the_optimizer_holds_none_of_the_models_variables():
    model = _compiled(LossScaleOptimizer(keras.optimizers.Adam(1e-3)), "keras_step")
    model.fit(X, Y, epochs=1, verbose=0)
    model_variables = {id(variable) for variable in model.weights}
    assert [v.path for v in model.optimizer.variables if id(v) in model_variables] == []


@pytest.mark.parametrize("accumulation", [None, 2])
def test_a_loaded_float8_model_keeps_its_optimizers_state_by_variable(tmp_path, accumulation):
    """A loaded float8 layer lists its float8 state before its kernel: state by path."""
    inner = keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation)
    model = _compiled(LossScaleOptimizer(inner, initial_scale=2.0**20), "keras_step")
    for _ in range(3):
        model.train_on_batch(X, Y)
    counts = model.optimizer.nonfinite_counts()
    assert counts["hidden/kernel"] > 0  # The scale overflows float16.
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert [v.path for v in loaded.trainable_variables] != [
        v.path for v in model.trainable_variables
    ]
    assert loaded.optimizer.nonfinite_counts() == counts
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy(), err_msg=saved.path)


def test_a_census_for_a_gpu_target_is_refused_on_tensorflow_in_one_line():
    """Only JAX's CUDA plugin compiles for a GPU without one (the census on JAX:
    tests/jax_backend/test_float8_census_for_a_gpu.py); refused before the model is read."""
    with pytest.raises(UserInputError) as raised:
        take_census(None, None, target="h100")
    assert str(raised.value) == (
        "float8 census for GPU target 'h100': received Keras backend 'tensorflow'. Allowed: "
        "jax (JAX's CUDA plugin compiles for a GPU without one)"
    )

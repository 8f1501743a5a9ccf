"""Tests of scaling.compile_hook: every path to float16 layers compiles with our loss scaling."""

import importlib
import inspect
import logging
import warnings

import keras
import numpy as np
import pytest

import mpt_keras
from mpt_keras import compat
from mpt_keras.execution import xla
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.policies import global_policy
from mpt_keras.scaling import compile_hook as autoscale
from mpt_keras.scaling.optimizer import LossScaleOptimizer

OURS = "mpt_keras.LossScaleOptimizer"
WRAPPED = "model 'net' computes in float16 (1 of its layers): compiling its Adam wrapped in " + OURS


@pytest.fixture
def logged(caplog):
    """The messages mpt_keras.scaling.compile_hook logs (info and above) during the test."""
    caplog.set_level(logging.INFO, logger=autoscale.__name__)
    return lambda: [
        (record.levelname, record.getMessage())
        for record in caplog.records
        if record.name == autoscale.__name__
    ]


def _net(policy: str = "mixed_float16") -> keras.Model:
    """Dense(8) -> Dense(1) named 'net', the manifest's `policy` applied: only `hidden`
    computes in float16 under mixed_float16 (the output layer stays float32)."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden), name="net")
    PrecisionManifest(policy).apply(model)
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")


def test_a_manifest_model_compiled_with_a_name_trains_with_ours(logged):
    # Seeded: about one initialization in six overflows the hidden kernel's float16 gradient.
    keras.utils.set_random_seed(0)
    model = _net()
    assert model.dtype_policy.name == "float32"  # Keras itself would not wrap.
    model.compile(optimizer="adam", loss="mse")
    optimizer = model.optimizer
    assert type(optimizer) is LossScaleOptimizer
    assert type(optimizer.inner_optimizer) is keras.optimizers.Adam
    assert logged() == [("INFO", WRAPPED)]

    before = [weight.copy() for weight in model.get_weights()]
    model.fit(*_data(), batch_size=4, verbose=0)
    assert int(optimizer.iterations) == 2
    assert optimizer.skipped_steps == 0
    assert optimizer.loss_scale == 32768.0  # 2 finite steps, growth after 2000.
    for old, new in zip(before, model.get_weights()):
        assert np.isfinite(new).all()
        assert (new != old).any()


def test_a_global_mixed_float16_policy_gets_ours_with_keras_settings(logged):
    with global_policy("mixed_float16"):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")],
            name="net",
        )
        model.compile(optimizer="adam", loss="mse")
    keras_defaults = inspect.signature(keras.optimizers.LossScaleOptimizer).parameters
    optimizer = model.optimizer
    assert type(optimizer) is LossScaleOptimizer
    assert optimizer.name == "loss_scale_optimizer"  # The name of Keras' own wrap.
    assert optimizer.initial_scale == keras_defaults["initial_scale"].default == 2.0**15
    assert optimizer.dynamic_growth_steps == keras_defaults["dynamic_growth_steps"].default == 2000
    assert logged() == [("INFO", WRAPPED)]


def test_an_explicit_stock_loss_scale_optimizer_is_kept_with_a_warning(logged):
    model = _net()
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=stock, loss="mse")
    assert model.optimizer is stock
    assert logged() == [
        (
            "WARNING",
            "model 'net' computes in float16 (1 of its layers): kept the LossScaleOptimizer "
            f"passed to compile; {OURS} adds scale bounds, one finiteness verdict for all "
            "replicas, bad-batch skipping and telemetry",
        )
    ]


def test_ours_passed_is_kept_silently(logged):
    model = _net()
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    model.compile(optimizer=ours, loss="mse")
    assert model.optimizer is ours
    assert logged() == []


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_model_without_float16_keeps_its_optimizer(policy, logged):
    model = _net(policy)
    adam = keras.optimizers.Adam()
    model.compile(optimizer=adam, loss="mse")
    assert model.optimizer is adam
    assert logged() == []


def test_auto_scale_loss_false_is_respected_with_a_warning(logged):
    model = _net()
    adam = keras.optimizers.Adam()
    model.compile(optimizer=adam, loss="mse", auto_scale_loss=False)
    assert model.optimizer is adam
    assert logged() == [
        (
            "WARNING",
            "model 'net' computes in float16 (1 of its layers) and was compiled with "
            "auto_scale_loss=False: its gradients are not loss scaled, so small ones underflow "
            f"to zero. To scale them, compile with optimizer={OURS}(...) or without "
            "auto_scale_loss=False",
        )
    ]


def test_a_float16_layer_in_a_nested_model_is_found(logged):
    inputs = keras.Input((4,))
    half = keras.layers.Dense(3, dtype="mixed_float16", name="half")(inputs)
    inner = keras.Model(inputs, half, name="inner")
    model = keras.Sequential(
        [keras.Input((4,)), inner, keras.layers.Dense(1, name="out")], name="net"
    )
    adam = keras.optimizers.Adam()
    model.compile(optimizer=adam, loss="mse")
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.optimizer.inner_optimizer is adam
    assert logged() == [("INFO", WRAPPED)]


def test_compile_model_of_xla_gets_ours():
    model = _net()
    sgd = keras.optimizers.SGD(0.1)
    xla.compile_model(model, optimizer=sgd, loss="mse", jit_compile=False)
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.optimizer.inner_optimizer is sgd


def test_a_saved_model_compiles_on_load_with_ours(tmp_path):
    model = _net()
    model.compile(optimizer="adam", loss="mse")
    model.fit(*_data(), batch_size=4, verbose=0)
    model.save(tmp_path / "net.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(tmp_path / "net.keras")
    # Keras compiles a loaded model only if its compile is Trainer.compile, and
    # loads the optimizer's variables only if they are the ones saved.
    assert [str(warning.message) for warning in caught] == []
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert int(loaded.optimizer.iterations) == 2
    assert loaded.optimizer.loss_scale == 32768.0


def test_installing_again_hooks_compile_once(monkeypatch, logged):
    trainer = compat.keras_trainer_class()
    keras_compile = trainer.compile.__wrapped__
    monkeypatch.setattr(trainer, "compile", keras_compile)
    autoscale.install()
    autoscale.install()
    assert trainer.compile.__wrapped__ is keras_compile
    model = _net()
    adam = keras.optimizers.Adam()
    model.compile(optimizer=adam, loss="mse")
    assert model.optimizer.inner_optimizer is adam
    assert logged() == [("INFO", WRAPPED)]


def test_import_mpt_keras_installs_the_hook(monkeypatch):
    trainer = compat.keras_trainer_class()
    keras_compile = trainer.compile.__wrapped__
    monkeypatch.setattr(trainer, "compile", keras_compile)
    importlib.reload(mpt_keras)
    assert trainer.compile.__wrapped__ is keras_compile


@pytest.mark.parametrize("saved_scale", [128.0, float("inf"), 0.0])
def test_a_file_saved_with_the_stock_optimizer_loads_with_ours_and_its_state(tmp_path, saved_scale):
    """Keras' own scale may have gone to inf or 0 (its bugs): ours clamps it on load."""
    model = _net()
    stock = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64.0, dynamic_growth_steps=3
    )
    model.compile(optimizer=stock, loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # Kept in code.
    stock.dynamic_scale.assign(saved_scale)
    path = tmp_path / "stock.keras"
    model.save(path)

    restored = keras.saving.load_model(path)
    ours = restored.optimizer
    assert type(ours) is LossScaleOptimizer
    assert ours.loss_scale == min(max(saved_scale, ours.min_scale), ours.max_scale)
    assert (ours.growth_interval, int(ours.step_counter.numpy())) == (
        3,
        int(stock.step_counter.numpy()),
    )
    assert int(ours.iterations) == int(stock.iterations)
    for saved, loaded in zip(stock.inner_optimizer.variables, ours.inner_optimizer.variables):
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy(), err_msg=saved.path)
    restored.fit(x, y, batch_size=4, verbose=0)
    assert int(ours.iterations) > int(stock.iterations)

"""On Keras' JAX backend with TensorFlow not importable (tests/test_jax_backend.py's child)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import keras
import numpy as np
import pytest

import mpt_keras

ON_JAX = sorted(mpt_keras.__all__)  # Every public name.


def test_this_process_runs_jax_and_cannot_import_tensorflow():
    assert keras.backend.backend() == "jax"
    with pytest.raises(ModuleNotFoundError, match="^No module named 'tensorflow'$"):
        importlib.import_module("tensorflow")
    # Found nowhere, as on a machine without it: libraries that probe for it go on.
    assert importlib.util.find_spec("tensorflow") is None
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("name", ON_JAX)
def test_public_names_served_on_jax_load_without_tensorflow(name):
    assert getattr(mpt_keras, name) is not None
    assert "tensorflow" not in sys.modules


def test_under_data_parallel_a_nan_in_one_devices_half_skips_the_step_for_all():
    """The child runs with two CPU devices (XLA's host platform device count)."""
    import jax
    import numpy as np

    assert len(jax.devices()) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.set_weights([np.ones((3, 1), "float32"), np.zeros((1,), "float32")])
        opt = mpt_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
        x = np.ones((8, 3), "float32")
        x[5, 0] = np.nan  # In the second device's half of the second batch.
        model.fit(x, np.ones((8, 1), "float32"), batch_size=4, shuffle=False, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    assert (opt.skipped_steps, opt.bad_batches, int(opt.iterations)) == (1, 1, 2)
    assert opt.health().bad_batch_steps == (2,)
    assert np.isfinite(model.get_weights()[0]).all()


def test_a_float8_manifest_applies_and_the_report_reads_each_layers_dtypes():
    import numpy as np

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="hidden")(inputs)
    normed = keras.layers.LayerNormalization(name="norm")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(normed))
    manifest = mpt_keras.PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_bfloat16",
            "safe_defaults": True,
            "rules": [{"match": {"path": "hidden"}, "policy": "float8"}],
        }
    )
    report = manifest.apply(model)
    rows = {layer.path: layer for layer in report.layers}
    assert rows["hidden"].policy == "float8_from_mixed_bfloat16"
    assert rows["hidden"].compute_dtype == "bfloat16"
    assert rows["hidden"].output_dtype == "bfloat16"  # Its float8 call, recorded too.
    assert rows["out"].output_dtype == "float32"  # Read from the trace (jax.eval_shape).
    assert rows["norm"].compute_dtype == "float32"  # A safe default.
    assert rows["out"].compute_dtype == "float32"  # The output layer, too.
    assert report.output_dtype_mismatches == ()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 8), "float32"), np.ones((4, 4), "float32"), verbose=0)
    assert float(keras.ops.convert_to_tensor(model.layers[1].inputs_scale)) > 0


@pytest.mark.parametrize(
    ("capability", "expected"),
    [("9.0", (9, 0)), ("8.6", (8, 6)), ("", (0, 0))],
)
def test_auto_reads_jax_gpus_compute_capability(monkeypatch, capability, expected):
    import jax

    class Gpu:
        platform = "gpu"
        compute_capability = capability

    monkeypatch.setattr(jax, "devices", lambda: [Gpu()])
    probe = mpt_keras.probe_hardware("/nonexistent")
    assert probe.gpu_compute_capabilities == (expected,) and not probe.tpu
    policy = mpt_keras.resolve_auto_policy(probe)[0]
    assert policy == ("mixed_bfloat16" if expected >= (8, 0) else "float32")


def test_auto_on_this_cpu_is_what_its_flags_say():
    probe = mpt_keras.probe_hardware()
    assert probe.gpu_compute_capabilities == () and not probe.tpu
    bfloat16 = {"avx512_bf16", "amx_bf16"} & probe.cpu_flags
    assert mpt_keras.resolve_auto_policy(probe)[0] == ("mixed_bfloat16" if bfloat16 else "float32")


def test_apply_on_jax_takes_the_variables_the_optimizer_was_built_on_or_says_so():
    from keras import ops

    a = keras.Variable(np.ones(2, "float32"), name="a")
    b = keras.Variable(np.ones(3, "float32"), name="b")
    opt = mpt_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="must be built"):
        opt.stateless_apply([], [ops.ones(2)], [a.value])
    opt.build([a, b])
    with pytest.raises(mpt_keras.UserInputError) as raised:
        opt.apply([ops.ones(3)], [b])
    assert str(raised.value) == (
        "On Keras' JAX backend, apply()'s variables: received 1 variables. "
        "Allowed: the 2 variables the optimizer was built on, in their order"
    )

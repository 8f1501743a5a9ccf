"""mpt-bench on Keras' JAX backend, without TensorFlow: the suite, its refusal, `fit`'s step loop.

What it measures is never asserted (no timing test); what it writes, and that the steps it
times train as `fit` trains, is.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
from launchers import launch_in_process

from benchmarks import harness

# The reference MLP on 8x8 images: 64 -> 128 -> 64 -> 10, 2 FLOPs per multiply-add, x3.
MLP_TRAIN_STEP_FLOPS_PER_IMAGE = 3 * 2 * (64 * 128 + 128 * 64 + 64 * 10)
TINY = (
    "--models=mlp",
    "--image_batch_size=8",
    "--rounds=1",
    "--steps_per_round=1",
    "--warmup_steps=1",
    "--memory_steps=1",
    "--matmul_size=32",
    "--matmul_rounds=1",
)


def test_the_suite_runs_on_jax_with_xla_on_and_writes_what_it_measured(tmp_path):
    output = tmp_path / "bench"
    bench = launch_in_process(
        "mpt-bench",
        *TINY,
        "--precisions=float32,mixed_float16",
        "--float8",
        f"--output={output}",
    )
    assert bench.status == 0, bench.stderr
    result = json.loads((output / "bench.json").read_text())
    assert set(result["variants"]) == {
        "mlp/float32/xla_on/ours",
        "mlp/float32/xla_on/stock",
        "mlp/mixed_float16/xla_on/ours",
        "mlp/mixed_float16/xla_on/stock",
        "mlp/mixed_float16+float8/xla_on/ours",
        "mlp/mixed_float16+float8/xla_on/stock",
    }
    machine = result["machine"]
    assert machine["jax"] and "tensorflow" not in machine
    assert result["matmul_peak"]["kernel"] == "XLA (jax.jit)"
    assert result["methods"]["memory"].startswith("peak_memory_bytes, step_memory_bytes not")
    for name, record in result["variants"].items():
        assert record["train_step_flops"] == 8 * MLP_TRAIN_STEP_FLOPS_PER_IMAGE, name
        assert record["peak_memory_bytes"] is None and record["step_memory_bytes"] is None
        assert record["variable_bytes"] > 0 and record["median_step_seconds"] > 0
    census = result["variants"]["mlp/mixed_float16+float8/xla_on/ours"]["float8"]["census"]
    # Three GEMMs a layer, less the first layer's input gradient (the images need none).
    assert census["summary"] == (
        "emulated: 0 of 8 GEMMs of 3 float8 layers run in float8 "
        "(no GPU: this machine has no float8 matmul units)"
    )
    assert result["auto_jit_compile"]["mlp/float32"]["jit_compile"] is True
    assert "JAX " in bench.stdout.splitlines()[-1]
    assert (output / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_profile_steps_is_one_line_on_jax_before_anything_is_measured(tmp_path):
    bench = launch_in_process("mpt-bench", *TINY, "--profile_steps=1", f"--output={tmp_path}")
    assert bench.status == 2
    assert bench.stderr.strip() == (
        "mpt-bench: error: profile_steps 1: the op profile reads TensorFlow's profiler, and "
        "this is Keras' JAX backend. Allowed here: 0 (no profile)"
    )
    assert os.listdir(tmp_path) == []


class _ReadsTheWeights(keras.callbacks.Callback):
    """Reads a weight after every step: `self.model` syncs the state back, as in `fit`."""

    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(keras.ops.convert_to_numpy(self.model.layers[-1].kernel))


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_the_timed_loop_trains_as_fit_does_with_a_callback_reading_the_state():
    x = np.arange(12, dtype="float32").reshape(4, 3) / 10
    y = np.ones((4, 2), "float32")
    fitted = _model()
    fitted.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)

    looped, reader = _model(), _ReadsTheWeights()
    loop = harness.FitLoop(
        looped, harness.step_iterator(harness.endless_batches(x, y, 2)), [reader]
    )
    loop(3)
    loop(1)
    loop.end()
    assert int(looped.optimizer.iterations.numpy()) == 4
    for trained, weight in zip(fitted.get_weights(), looped.get_weights(), strict=True):
        np.testing.assert_allclose(weight, trained, rtol=1e-6)
    # Each step's state reached the callback, and the next step went on from it.
    assert len(reader.kernels) == 4
    np.testing.assert_allclose(reader.kernels[-1], fitted.layers[-1].kernel.numpy(), rtol=1e-6)
    assert not np.allclose(reader.kernels[0], reader.kernels[1])

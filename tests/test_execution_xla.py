"""Tests for mpt_keras.execution.xla: XLA for the whole step on one device, or per replica.

Single-device cases run in the pytest process. The two-replica cases need the
CPU split into two logical devices before TensorFlow initializes its runtime,
so they run once in a child process (`_CHILD` imports this module and calls
`_distributed_results`, with XLA dumping the HLO modules it compiles), and the
tests assert on the JSON it prints.

Equivalence (`test_losses_agree_across_xla_and_replicas`): 6 SGD steps of an
MLP from the same weights on the same global batches, with and without XLA, on
1 and 2 replicas, agree with the 1-replica run without XLA to `TOLERANCES`. The
largest deviations measured (losses relative, weights absolute):

    float32         9e-8, 6e-8    summation order only
    mixed_float16   2e-5, 2e-5    2 replicas: float16 partial sums of half
                                  batches (XLA on 1 replica: identical losses,
                                  weights within 3e-8)
    mixed_bfloat16  3e-3, 2e-2    each bfloat16 rounding keeps 8 bits (unit
                                  roundoff 2**-8 = 4e-3); XLA's fusions round
                                  at other points than TensorFlow's kernels,
                                  2 replicas round half-batch sums, and SGD
                                  carries the differences over the steps

The child runs TensorFlow's own kernels, not oneDNN's (`TF_ENABLE_ONEDNN_OPTS=0`):
on a CPU with AVX512_FP16 oneDNN computes float16 natively, and XLA's float16
step differs from it by 1.4e-3 of a loss and 1.4e-2 of a weight (an Intel Xeon,
2026-12-06), where TensorFlow's own kernels agree with XLA's as above.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras import compat, models
from mpt_keras.errors import UserInputError
from mpt_keras.execution import xla
from mpt_keras.precision.names import POLICY_NAMES
from mpt_keras.precision.policies import global_policy
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_TESTS_DIR = Path(__file__).resolve().parent
_CHILD = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import json, sys, test_execution_xla
print(json.dumps(test_execution_xla._distributed_results(sys.argv[1])))
"""
# (rtol of losses, atol of weights): the measured deviations (module
# docstring), with a margin of 3 or more.
TOLERANCES = {
    "float32": (1e-6, 1e-6),
    "mixed_float16": (1e-4, 1e-4),
    "mixed_bfloat16": (1e-2, 6e-2),
}
GLOBAL_BATCH = 16
STEPS = 6


def _data(
    steps: int = STEPS, nan_at: tuple[int, int] | None = None, value: float = np.nan
) -> tuple[np.ndarray, ...]:
    """Features and labels of `steps` global batches; `value` in (step, row) if given."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + 2 * (x[:, 2] > 0).astype("int32")
    if nan_at is not None:
        step, row = nan_at
        x[step * GLOBAL_BATCH + row, 3] = value
    return x, y


def _mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    return models.build_mlp((8,), 4, hidden_units=(32, 16), dropout=0.0)


def _compile(
    model: keras.Model,
    jit_compile: bool,
    inner: keras.optimizers.Optimizer | None = None,
    **compile_kwargs: Any,
) -> LossScaleOptimizer:
    optimizer = LossScaleOptimizer(inner or keras.optimizers.Adam(1e-2), growth_interval=2)
    xla.compile_model(
        model,
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
        **compile_kwargs,
    )
    return optimizer


# --- One device (in the pytest process) -----------------------------------


class _NoTrainingArgument(keras.Model):
    """A subclassed model whose call() takes no `training` argument."""

    def __init__(self):
        super().__init__(name="no_training_argument")
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(4)

    def call(self, inputs):
        return self.logits(self.hidden(inputs))


def _no_training_argument() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = _NoTrainingArgument()
    model(np.zeros((1, 8), np.float32))
    assert not compat.call_has_training_arg(model)
    return model


@pytest.mark.parametrize(
    ("make_model", "fit_kwargs", "compile_kwargs"),
    [
        pytest.param(_mlp, {}, {}, id="plain"),
        pytest.param(_no_training_argument, {}, {}, id="no_training_argument"),
        pytest.param(_mlp, {"sample_weight": True}, {}, id="sample_weight"),
        pytest.param(_mlp, {}, {"steps_per_execution": 3}, id="steps_per_execution"),
    ],
)
def test_xla_fit_matches_plain_fit_on_one_device(make_model, fit_kwargs, compile_kwargs):
    x, y = _data()
    weight = np.linspace(0.5, 2.0, len(x)).astype("float32")
    runs = {}
    for jit_compile in (False, True):
        model = make_model()
        _compile(model, jit_compile, **compile_kwargs)
        assert "train_step" in vars(model)
        history = model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            sample_weight=weight if fit_kwargs.get("sample_weight") else None,
        )
        runs[jit_compile] = history.history, [v.numpy() for v in model.trainable_variables]
    (plain_history, plain_weights), (xla_history, xla_weights) = runs[False], runs[True]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(xla_history[key], plain_history[key], rtol=1e-5)
    for got, want in zip(xla_weights, plain_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_sample_weights_reach_the_xla_loss():
    x, y = _data()
    losses = {}
    for name, weight in [("ones", np.ones(len(x))), ("zeros", np.zeros(len(x)))]:
        model = _mlp()
        _compile(model, jit_compile=True)
        losses[name] = model.fit(x, y, sample_weight=weight, batch_size=GLOBAL_BATCH, verbose=0)
    assert losses["ones"].history["loss"][0] > 0.1
    assert losses["zeros"].history["loss"][0] == 0.0


def _count_forward_backward_traces(monkeypatch) -> list[int]:
    """Counts the traces of XLA-compiled forward and backward passes."""
    traces = [0]
    original = xla.xla_function

    def counting(function):
        def replica_forward_backward(*args):
            traces[0] += 1
            return function(*args)

        return original(replica_forward_backward)

    monkeypatch.setattr(xla, "xla_function", counting)
    return traces


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_bad_batch_counts_in_no_metric(jit_compile):
    x, y = _data(steps=2, nan_at=(1, 3))
    model, twin = _mlp(), _mlp()
    _compile(model, jit_compile)
    _compile(twin, jit_compile)
    logs = model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0).history
    # The second batch is skipped: the epoch reports the first one alone.
    first_batch = x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]
    twin_logs = twin.fit(*first_batch, batch_size=GLOBAL_BATCH, verbose=0).history
    # To float32's rounding: under XLA the two programs may sum the batch's loss in another
    # order on some CPUs (one unit in the last place apart on an AVX512_BF16 EPYC, 2026-12-04);
    # a bad batch counted would make it NaN, or the mean of two batches.
    for metric in ("loss", "accuracy"):
        np.testing.assert_allclose(logs[metric], twin_logs[metric], rtol=2e-7, atol=0)
    assert (logs["skipped_steps"], logs["bad_batches"]) == ([1.0], [1.0])
    assert model.optimizer.bad_batches == 1


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_bad_batch_counts_in_no_per_output_loss(jit_compile):
    """`compute_loss` updates each output's loss tracker in the forward pass, before the
    optimizer judges the batch: they are put back too."""
    x, y = _data(steps=2, nan_at=(1, 3))
    histories = []
    for rows in (slice(None), slice(0, GLOBAL_BATCH)):  # With the bad batch; the first alone.
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        outputs = [keras.layers.Dense(4, name=name)(inputs) for name in ("a", "b")]
        model = keras.Model(inputs, outputs)
        optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        xla.compile_model(model, optimizer=optimizer, loss=[loss, loss], jit_compile=jit_compile)
        history = model.fit(
            x[rows], [y[rows], y[rows]], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0
        )
        histories.append(history.history)
    logs, twin_logs = histories
    assert logs["bad_batches"] == [1.0]
    for metric in ("loss", "a_loss", "b_loss"):
        np.testing.assert_allclose(logs[metric], twin_logs[metric], rtol=2e-7, atol=0)


def test_recompiling_switches_the_step(monkeypatch):
    traces = _count_forward_backward_traces(monkeypatch)
    x, y = _data(steps=2)
    model = _mlp()
    _compile(model, jit_compile=True)
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    xla_traces = traces[0]
    assert xla_traces > 0
    _compile(model, jit_compile=False)
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    assert traces[0] == xla_traces
    _compile(model, jit_compile=True)
    # A plain compile after compile_model gets Keras' own step.
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    assert traces[0] == xla_traces


def test_recompiling_with_another_loss_uses_it():
    x, y = _data(steps=1)
    model = _mlp()
    _compile(model, jit_compile=True)
    first_loss = model.train_on_batch(x, y, return_dict=True)["loss"]
    probabilities_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=False)
    xla.compile_model(model, optimizer="sgd", loss=probabilities_loss, jit_compile=True)
    twin = _mlp()
    twin.set_weights(model.get_weights())
    xla.compile_model(twin, optimizer="sgd", loss=probabilities_loss, jit_compile=False)
    # train_on_batch reports the loss before its update.
    loss = model.train_on_batch(x, y, return_dict=True)["loss"]
    assert loss == pytest.approx(twin.train_on_batch(x, y, return_dict=True)["loss"], rel=1e-6)
    assert loss != pytest.approx(first_loss, rel=0.1)


def test_saved_model_has_no_trace_of_the_xla_step(tmp_path):
    x, y = _data(steps=2)
    model = _mlp()
    plain = _mlp()
    _compile(plain, jit_compile=False)
    _compile(model, jit_compile=True)
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    assert model.get_config() == plain.get_config()
    compile_config, plain_compile_config = model.get_compile_config(), plain.get_compile_config()
    # The optimizers differ in their names' numbering only.
    assert (
        compile_config.pop("optimizer")["config"].keys()
        == plain_compile_config.pop("optimizer")["config"].keys()
    )
    assert compile_config == plain_compile_config
    assert compile_config["jit_compile"] is False
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    # No XLA step; only the compile hook's hand-over of each batch to our optimizer.
    step = vars(restored).get("train_step")
    assert step is None or "_hand_batches_over" in step.__qualname__
    assert restored.jit_compile is False
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0))
    # It trains, and with XLA again after compile_model.
    restored.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    _compile(restored, jit_compile=True)
    assert np.isfinite(restored.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0).history["loss"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"jit_compile": "true"},
            "jit_compile: received 'true'. Allowed: True or False",
        ),
        (
            {"jit_compile": True, "run_eagerly": True},
            "jit_compile=True cannot run eagerly. Received: run_eagerly=True; "
            "allowed with XLA: run_eagerly=False",
        ),
    ],
)
def test_compile_model_rejects_bad_arguments(kwargs, message):
    with pytest.raises(UserInputError) as info:
        xla.compile_model(_mlp(), optimizer="sgd", loss="mse", **kwargs)
    assert str(info.value) == message


_VARIABLE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def _variable_writes_in_and_out_of_xla(graph_def: Any) -> tuple[int, int]:
    """Variable writes in a traced step: inside XLA-compiled functions, and outside them."""
    library = {function.signature.name: function for function in graph_def.library.function}
    compiled, pending = set(), [n for n, f in library.items() if f.attr["_XlaMustCompile"].b]
    while pending:  # Functions called by compiled ones (cond branches) are compiled too.
        name = pending.pop()
        if name in library and name not in compiled:
            compiled.add(name)
            for node in library[name].node_def:
                for value in node.attr.values():
                    pending += [value.func.name] + [f.name for f in value.list.func]
    nodes = {name: function.node_def for name, function in library.items()}
    inside = sum(node.op in _VARIABLE_WRITES for n in compiled for node in nodes[n])
    outside = sum(
        node.op in _VARIABLE_WRITES
        for node in [*graph_def.node, *(x for n in nodes if n not in compiled for x in nodes[n])]
    )
    return inside, outside


@pytest.mark.parametrize(
    ("make_strategy", "whole_step"),
    [
        pytest.param(tf.distribute.get_strategy, True, id="no_strategy"),
        pytest.param(lambda: tf.distribute.OneDeviceStrategy("/cpu:0"), True, id="one_device"),
        # Its update goes through merge_call, which a nested function cannot hold.
        pytest.param(lambda: tf.distribute.MirroredStrategy(["/cpu:0"]), False, id="mirrored"),
    ],
)
def test_xla_compiles_the_whole_step_on_one_device(make_strategy, whole_step):
    strategy = make_strategy()
    x, y = _data(steps=1)
    with strategy.scope():
        model = _mlp()
        _compile(model, jit_compile=True)
    model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)  # Builds the optimizer.
    step = tf.function(lambda data: strategy.run(model.train_step, args=(data,)))
    graph_def = step.get_concrete_function((tf.constant(x), tf.constant(y))).graph.as_graph_def()
    inside, outside = _variable_writes_in_and_out_of_xla(graph_def)
    # The 42 writes in the step's graph (weights, Adam's slots, the loss
    # scale's counters in each branch that writes them, the metrics and their
    # restore after a bad batch): all in XLA on one device, all outside it
    # under a strategy.
    assert (inside, outside) == ((42, 0) if whole_step else (0, 42))


# --- Two replicas (run in a child process, see the module docstring) -------


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict[str, Any]:
    dump_dir = tmp_path_factory.mktemp("xla_dump")
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} "
        "--xla_dump_hlo_module_re=.*forward_backward.*",
        # The same numbers on any CPU (module docstring).
        TF_ENABLE_ONEDNN_OPTS="0",
    )
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_TESTS_DIR.parent), str(_TESTS_DIR), env.get("PYTHONPATH", "")]
    )
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dump_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_xla_compiles_each_replicas_forward_backward_only(distributed):
    compiled = distributed["compiled"]
    # One XLA module per replica for the XLA run; none for the plain run.
    assert compiled["xla_modules"] == 2
    assert compiled["plain_modules"] == 0
    # The all-reduce stays outside XLA, with the strategy.
    assert compiled["cross_replica_ops_in_xla"] == 0


@pytest.mark.parametrize("precision", POLICY_NAMES)
def test_losses_agree_across_xla_and_replicas(distributed, precision):
    runs = distributed["equivalence"][precision]
    reference = runs["1_replica_plain"]
    loss_rtol, weight_atol = TOLERANCES[precision]
    assert set(runs) == {"1_replica_plain", "1_replica_xla", "mirrored_plain", "mirrored_xla"}
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], reference["losses"], rtol=loss_rtol, err_msg=name)
        np.testing.assert_allclose(
            run["weights"], reference["weights"], rtol=0, atol=weight_atol, err_msg=name
        )
        assert run["replica_weights_equal"], name
        # The loss scale evolved the same on every replica of every run.
        assert all(len(set(step)) == 1 for step in run["scales"]), name
        assert [step[0] for step in run["scales"]] == [step[0] for step in reference["scales"]]
    # growth_interval=2: the scale doubled every second step.
    assert [step[0] for step in reference["scales"]] == [2.0**e for e in (15, 16, 16, 17, 17, 18)]


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_overflow_on_one_replica_under_xla_skips_the_step_on_both(distributed, bad_replica):
    # A float32 input of 1e5 is finite data, but inf in float16 compute.
    run = distributed["overflow"][bad_replica]
    # Step 2 (0-based 1) overflows: weights unchanged on both replicas.
    assert run["unchanged_at_bad_step"] == [True, True]
    assert run["replica_weights_equal"]
    # growth_interval=2: 32768 -> 65536 after step 2, if it were finite.
    assert run["scales"] == [[32768.0, 32768.0], [16384.0, 16384.0], [16384.0, 16384.0]]
    assert (run["skipped_steps"], run["bad_batches"]) == (1, 0)
    assert run["finite_weights"]


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_nan_data_on_one_replica_under_xla_is_a_bad_batch_on_both(distributed, bad_replica):
    run = distributed["nan"][bad_replica]
    assert run["unchanged_at_bad_step"] == [True, True]
    assert run["replica_weights_equal"]
    # Bad data is no overflow: the scale keeps its course and grows after
    # two finite steps (steps 1 and 3).
    assert run["scales"] == [[32768.0, 32768.0], [32768.0, 32768.0], [65536.0, 65536.0]]
    assert (run["skipped_steps"], run["bad_batches"], run["bad_batch_steps"]) == (1, 1, [2])
    assert run["finite_weights"]


# --- Child process --------------------------------------------------------


class _Recorder(keras.callbacks.Callback):
    """Per step: each replica's loss scale, and whether each replica's weights moved."""

    def __init__(self, strategy: tf.distribute.Strategy):
        super().__init__()
        self._strategy = strategy
        self.scales: list[list[float]] = []
        self.unchanged: list[list[bool]] = []

    def _replica_weights(self) -> list[list[np.ndarray]]:
        local = [
            self._strategy.experimental_local_results(v.value)
            for v in self.model.trainable_variables
        ]
        return [[w.numpy() for w in replica] for replica in zip(*local)]

    def on_train_batch_begin(self, batch, logs=None):
        self._before = self._replica_weights()

    def on_train_batch_end(self, batch, logs=None):
        after = self._replica_weights()
        self.unchanged.append(
            [
                all(np.array_equal(a, b) for a, b in zip(before, now))
                for before, now in zip(self._before, after)
            ]
        )
        optimizer = self.model.optimizer
        self.scales.append(
            [
                float(s)
                for s in self._strategy.experimental_local_results(optimizer.dynamic_scale.value)
            ]
        )


def _train(
    strategy: tf.distribute.Strategy,
    precision: str,
    jit_compile: bool,
    data: tuple[np.ndarray, np.ndarray],
) -> dict[str, Any]:
    with global_policy(precision), strategy.scope():
        model = _mlp()
        # SGD: weight differences stay proportional to gradient differences
        # (Adam's normalisation would blow up those of near-zero gradients).
        optimizer = _compile(model, jit_compile, keras.optimizers.SGD(0.2))
    recorder = _Recorder(strategy)
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(
        dataset.repeat(),
        epochs=len(x) // GLOBAL_BATCH,
        steps_per_epoch=1,
        callbacks=[recorder],
        verbose=0,
    )
    replicas = [strategy.experimental_local_results(v.value) for v in model.trainable_variables]
    return {
        "losses": history.history["loss"],
        "weights": np.concatenate([v.numpy().ravel() for v in model.trainable_variables]).tolist(),
        "replica_weights_equal": all(
            all(np.array_equal(copies[0].numpy(), c.numpy()) for c in copies) for copies in replicas
        ),
        "finite_weights": all(np.isfinite(v.numpy()).all() for v in model.trainable_variables),
        "scales": recorder.scales,
        "unchanged": recorder.unchanged,
        "skipped_steps": optimizer.skipped_steps,
        "bad_batches": optimizer.bad_batches,
        "bad_batch_steps": optimizer.bad_batch_steps(),
    }


def _count_modules(dump_dir: str) -> tuple[int, int]:
    """(XLA modules compiled so far, how many of them hold a cross-replica op)."""
    texts = [
        Path(dump_dir, name).read_text()
        for name in sorted(os.listdir(dump_dir))
        if name.endswith(".before_optimizations.txt")
    ]
    cross_replica = ("all-reduce", "all-gather", "collective", "reduce-scatter")
    return len(texts), sum(any(op in text for op in cross_replica) for text in texts)


def _distributed_results(dump_dir: str) -> dict[str, Any]:
    """Runs the two-replica scenarios; needs two logical CPU devices."""
    # MultiWorkerMirroredStrategy runs in tests/test_backend_tensorflow_distribute.py, with two
    # real workers: in one process, its collective keys and MirroredStrategy's
    # (which all-reduces with collectives on CPUs too) collide.
    strategies = {
        "1_replica": tf.distribute.get_strategy(),
        "mirrored": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    }
    runs: dict[str, dict[str, Any]] = {precision: {} for precision in POLICY_NAMES}
    data = _data()
    # The first two runs also count the XLA modules each one compiled.
    runs["float32"]["mirrored_xla"] = _train(strategies["mirrored"], "float32", True, data)
    xla_modules, cross_replica = _count_modules(dump_dir)
    runs["float32"]["mirrored_plain"] = _train(strategies["mirrored"], "float32", False, data)
    results: dict[str, Any] = {
        "compiled": {
            "xla_modules": xla_modules,
            "plain_modules": _count_modules(dump_dir)[0] - xla_modules,
            "cross_replica_ops_in_xla": cross_replica,
        },
        "equivalence": runs,
    }
    for precision in POLICY_NAMES:
        for name in strategies:
            for jit_compile in (False, True):
                key = f"{name}_{'xla' if jit_compile else 'plain'}"
                if key not in runs[precision]:
                    runs[precision][key] = _train(strategies[name], precision, jit_compile, data)

    for scenario, value in (("overflow", 1e5), ("nan", np.nan)):
        results[scenario] = []
        for bad_replica in (0, 1):
            # Row 3 of a global batch of 16 goes to replica 0, row 11 to replica 1.
            bad_data = _data(steps=3, nan_at=(1, 3 + 8 * bad_replica), value=value)
            run = _train(strategies["mirrored"], "mixed_float16", True, bad_data)
            results[scenario].append(
                {
                    "unchanged_at_bad_step": run["unchanged"][1],
                    "replica_weights_equal": run["replica_weights_equal"],
                    "scales": run["scales"],
                    "skipped_steps": run["skipped_steps"],
                    "bad_batches": run["bad_batches"],
                    "bad_batch_steps": run["bad_batch_steps"],
                    "finite_weights": run["finite_weights"],
                }
            )
    return results

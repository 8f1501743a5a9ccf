"""Tests of mpt_keras.compat: one per private Keras or TensorFlow touch.

Each fails with a message naming the Keras and TensorFlow versions, so that an
upgrade that breaks a touch says which one, here, before a training run does.
"""

import inspect
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from replicas import on_two_cpus, run_on_two_cpus, two_cpu_strategy

from mpt_keras import compat
from mpt_keras.compat import jax_trainer

# Its two-replica cases run in the two-CPU host (tests/replicas.py).
pytestmark = on_two_cpus

VERSIONS = f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def test_every_touched_name_is_there():
    assert compat.check() == [], f"{VERSIONS} no longer has: {compat.check()}"


def test_check_names_each_missing_touch(monkeypatch):
    monkeypatch.delattr(tf.distribute.StrategyExtended, "_in_multi_worker_mode")
    monkeypatch.delattr(compat.keras_trainer_class(), "_symbolic_build")
    monkeypatch.delattr(jax_trainer.jax_trainer_class(), "_get_jax_state")
    assert compat.check() == [
        "keras.src.backend.jax.trainer.JAXTrainer._get_jax_state",
        "tf.distribute.StrategyExtended._in_multi_worker_mode",
        "keras.Model._symbolic_build",
    ]


def test_maybe_merge_call_calls_with_the_strategy_outside_a_strategy():
    strategy = tf.distribute.get_strategy()
    assert compat.maybe_merge_call(lambda s, x: (s, x + 1), strategy, 1) == (strategy, 2), (
        f"{VERSIONS}: maybe_merge_call changed"
    )


def _if_ops_and_result(pred: bool) -> tuple[list, float]:
    variable = tf.Variable(0.0)

    def add_one() -> None:
        variable.assign_add(1.0)

    @tf.function
    def step(pred: tf.Tensor) -> tf.Tensor:
        compat.called_cond(pred, add_one, lambda: None)
        return variable.read_value()

    result = float(step(tf.constant(pred)))
    graph = step.get_concrete_function(tf.constant(pred)).graph
    lowering = [
        op.get_attr("_lower_using_switch_merge")
        for op in graph.get_operations()
        if op.type in ("If", "StatelessIf")
    ]
    return lowering, result


def test_called_cond_is_one_unlowered_if_that_runs_the_chosen_branch():
    assert _if_ops_and_result(True) == ([False], 1.0), (
        f"{VERSIONS}: the If op's _lower_using_switch_merge attribute changed"
    )
    assert _if_ops_and_result(False) == ([False], 0.0)
    ran = []
    compat.called_cond(tf.constant(True), lambda: ran.append(True), lambda: ran.append(False))
    assert ran == [True]  # Eagerly: the branch, no If op.


def lowering_under_two_replicas() -> list:
    """`_if_ops_and_result(True)` under a strategy over two CPUs (in the two-CPU host)."""
    with two_cpu_strategy().scope():
        lowering, result = _if_ops_and_result(True)
    return [lowering, result]


def test_called_cond_stays_lowered_across_several_devices():
    # An unlowered If cannot place a branch writing on two devices.
    assert run_on_two_cpus("test_compat", "lowering_under_two_replicas") == [[True], 1.0]


def test_reduce_per_replica_means_over_replicas_as_keras_train_function():
    strategy = tf.distribute.get_strategy()
    outputs = {"loss": tf.constant(2.0)}
    assert compat.reduce_per_replica(outputs, strategy) == outputs, (
        f"{VERSIONS}: keras.src.backend.tensorflow.trainer.reduce_per_replica changed"
    )


def test_skip_stock_build_builds_the_base_optimizer_only():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    variable = keras.Variable([0.0])
    compat.skip_stock_build(optimizer, [variable])
    assert optimizer.built
    assert not hasattr(optimizer, "dynamic_scale"), f"{VERSIONS}: the stock build ran"


def _compiled_model() -> keras.Model:
    """A compiled functional Dense(2) -> Dense(1), with every object named."""
    inputs = keras.Input((3,), name="compat_input")
    hidden = keras.layers.Dense(2, name="compat_hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="compat_out")(hidden), name="compat")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, name="compat_sgd"),
        loss=keras.losses.MeanSquaredError(name="compat_mse"),
    )
    return model


def _batch() -> tuple[np.ndarray, np.ndarray]:
    return np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")


class _NoTrainingArgument(keras.Model):
    """A subclassed model whose `call` and `compute_loss` take no `training`."""

    def __init__(self):
        super().__init__(name="compat_subclassed")
        self.dense = keras.layers.Dense(1, name="compat_subclassed_dense")

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x, y, y_pred, sample_weight):
        return keras.ops.sum(y_pred) * 0.0 + 7.0


def test_keras_trainer_class_has_the_compile_every_model_runs():
    """Written for Keras 3.15.1: the compile hook replaces this class's `compile`."""
    try:
        trainer = compat.keras_trainer_class()
    except ImportError as error:
        pytest.fail(f"{VERSIONS}: keras.src.trainers.trainer.Trainer changed: {error}")
    assert callable(getattr(trainer, "compile", None)), f"{VERSIONS}: Trainer has no compile()"
    for model_class in (
        keras.Model,
        keras.Sequential,
        type(_compiled_model()),
        _NoTrainingArgument,
    ):
        assert model_class.compile is trainer.compile, (
            f"{VERSIONS}: {model_class.__name__}.compile is no longer Trainer.compile"
        )
    parameters = inspect.signature(trainer.compile).parameters
    assert {"optimizer", "auto_scale_loss"} <= set(parameters), (
        f"{VERSIONS}: Trainer.compile's arguments changed: {list(parameters)}"
    )


def test_compile_config_is_new_at_each_compile():
    model = _compiled_model()
    first = compat.compile_config(model)
    assert first is not None, f"{VERSIONS}: a compiled model has no _compile_config"
    assert compat.compile_config(model) is first
    model.compile(optimizer="sgd", loss="mse")
    assert compat.compile_config(model) is not first, (
        f"{VERSIONS}: model._compile_config is no longer made anew by compile"
    )


def test_call_has_training_arg_tells_which_calls_take_training():
    assert compat.call_has_training_arg(_compiled_model()) is True, (
        f"{VERSIONS}: model._call_has_training_arg changed"
    )
    assert compat.call_has_training_arg(_NoTrainingArgument()) is False, (
        f"{VERSIONS}: model._call_has_training_arg changed"
    )


def test_compute_loss_is_the_compiled_loss_and_reaches_overrides_without_training():
    model = _compiled_model()
    x, y = _batch()
    y_pred = model(x)
    np.testing.assert_allclose(
        compat.compute_loss(model, x, y, y_pred, sample_weight=None),
        np.mean(np.square(keras.ops.convert_to_numpy(y_pred))),
        rtol=1e-6,
        err_msg=f"{VERSIONS}: model._compute_loss changed",
    )
    subclassed = _NoTrainingArgument()
    subclassed.compile(optimizer=keras.optimizers.SGD(name="compat_sgd"), loss="mse")
    loss = compat.compute_loss(subclassed, x, y, subclassed(x), sample_weight=None)
    assert float(loss) == 7.0, f"{VERSIONS}: model._compute_loss no longer drops `training`"


def test_loss_tracker_is_the_loss_metric_fit_reports():
    model = _compiled_model()
    tracker = compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean), f"{VERSIONS}: model._loss_tracker changed"
    assert tracker.name == "loss"
    assert any(metric is tracker for metric in model.metrics), (
        f"{VERSIONS}: model._loss_tracker is no longer among model.metrics"
    )


def test_unscale_loss_for_distribution_multiplies_by_the_replicas(monkeypatch):
    loss = tf.constant(3.0)
    assert float(compat.unscale_loss_for_distribution(loss)) == 3.0
    two_replicas = types.SimpleNamespace(num_replicas_in_sync=2)
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: two_replicas)
    assert float(compat.unscale_loss_for_distribution(loss)) == 6.0, (
        f"{VERSIONS}: keras.src.losses.loss.unscale_loss_for_distribution changed"
    )


def test_stateless_value_is_what_the_scope_in_effect_maps_the_variable_to():
    mapped, other = keras.Variable(1.0), keras.Variable(2.0)
    assert compat.stateless_value(mapped) is None
    with keras.StatelessScope(state_mapping=[(mapped, keras.ops.convert_to_tensor(5.0))]):
        assert float(compat.stateless_value(mapped)) == 5.0, (
            f"{VERSIONS}: keras.src.backend.common.stateless_scope changed"
        )
        assert compat.stateless_value(other) is None


def test_learning_rate_schedule_is_the_schedule_given():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule, name="compat_sgd")
    assert compat.learning_rate_schedule(optimizer) is schedule, (
        f"{VERSIONS}: optimizer._learning_rate changed"
    )
    assert optimizer.learning_rate is not schedule


def test_replace_dtype_policy_replaces_a_policy_map():
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    layer = keras.layers.Dense(1, dtype=policy_map, name="compat_dense")
    compat.replace_dtype_policy(layer, keras.DTypePolicy("mixed_float16"))
    assert layer.dtype_policy.name == "mixed_float16", f"{VERSIONS}: layer._dtype_policy changed"
    assert (layer.compute_dtype, layer.variable_dtype) == ("float16", "float32")
    assert len(policy_map) == 0


def test_direct_sublayers_are_one_level_in_tracking_order():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="compat_block")
            self.first = keras.layers.Dense(2, name="compat_first")
            self.inner = keras.Sequential(
                [keras.layers.Dense(2, name="compat_nested")], name="inner"
            )

    block = Block()
    assert [layer.name for layer in compat.direct_sublayers(block)] == ["compat_first", "inner"], (
        f"{VERSIONS}: layer._flatten_layers changed"
    )
    assert compat.direct_sublayers(block.first) == []


def test_producing_layer_and_node_walk_a_functional_graph():
    model = _compiled_model()
    hidden, out = model.get_layer("compat_hidden"), model.get_layer("compat_out")
    assert compat.producing_layer(model.outputs[0]) is out, (
        f"{VERSIONS}: tensor._keras_history changed"
    )
    node = compat.producing_node(model.outputs[0])
    assert [compat.producing_layer(tensor) for tensor in node.input_tensors] == [hidden], (
        f"{VERSIONS}: layer._inbound_nodes changed"
    )
    # A layer called twice: each output names its own call.
    shared = keras.layers.Dense(2, name="compat_shared")
    first = shared(keras.Input((2,)))
    second = shared(first)
    assert compat.producing_layer(second) is shared
    assert [tensor is first for tensor in compat.producing_node(second).input_tensors] == [True]


def test_symbolic_build_builds_the_model_and_its_optimizer():
    model = keras.Sequential([keras.layers.Dense(1, name="compat_dense")], name="compat")
    model.compile(optimizer=keras.optimizers.SGD(name="compat_sgd"), loss="mse")
    assert not model.built
    compat.symbolic_build(model, _batch())
    assert model.built and model.optimizer.built, f"{VERSIONS}: model._symbolic_build changed"


def test_fit_builds_through_the_replaced_maybe_symbolic_build_until_restored():
    model = _compiled_model()
    calls = []
    compat.replace_maybe_symbolic_build(model, lambda **kwargs: calls.append(kwargs))
    model.fit(*_batch(), batch_size=4, verbose=0)
    assert len(calls) == 1 and calls[0]["iterator"] is not None, (
        f"{VERSIONS}: fit no longer calls model._maybe_symbolic_build(iterator=...)"
    )
    compat.restore_maybe_symbolic_build(model)
    model.fit(*_batch(), batch_size=4, verbose=0)
    assert len(calls) == 1
    assert "_maybe_symbolic_build" not in vars(model)


def test_in_multi_worker_mode_is_false_on_one_worker():
    for strategy in (tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy("/cpu:0")):
        assert compat.in_multi_worker_mode(strategy) is False, (
            f"{VERSIONS}: strategy.extended._in_multi_worker_mode changed"
        )


def test_call_records_restored_puts_back_what_calls_record():
    dense = keras.layers.Dense(2, activity_regularizer="l2", name="compat_records_dense")
    dense(np.ones((1, 3), "float32"))
    eager_loss = dense.losses[0]
    dropout = keras.layers.Dropout(0.5, name="compat_records_dropout")
    assert (dropout._called, dropout._parent_path) == (False, None)
    with compat.call_records_restored([dense, dropout]):
        dense(np.zeros((1, 3), "float32"))
        dropout(np.ones((1, 2), "float32"))
        assert dense.losses[0] is not eager_loss
        assert (dropout._called, dropout._parent_path) == (True, "")
    assert (dropout._called, dropout._parent_path) == (False, None), (
        f"{VERSIONS}: layer._called or layer._parent_path changed"
    )
    assert len(dense.losses) == 1 and dense.losses[0] is eager_loss, (
        f"{VERSIONS}: layer._losses changed"
    )


def test_graph_calls_are_the_nodes_a_model_runs_in_its_order():
    """Written for Keras 3.15.1: `Function._run_through_graph` runs `_nodes_by_depth`."""
    inputs = keras.Input((2,), name="compat_graph_input")
    shared = keras.layers.Dense(2, name="compat_graph_shared")
    hidden = keras.layers.Activation("relu", name="compat_graph_relu")(shared(inputs))
    model = keras.Model(inputs, shared(hidden), name="compat_graph")
    nodes = compat.graph_calls(model)
    assert [node.operation.name for node in nodes] == [
        "compat_graph_shared",
        "compat_graph_relu",
        "compat_graph_shared",
    ], f"{VERSIONS}: model._nodes_by_depth changed"
    assert nodes[-1].output_tensors[0] is model.outputs[0]
    called = []
    shared.call = lambda x, *rest, call=shared.call, **kw: called.append(x) or call(x, *rest, **kw)
    model(-np.ones((1, 2), "float32"))
    del shared.call
    # The run's first call of the shared layer took the input, its second the relu's output.
    smallest = [float(np.min(keras.ops.convert_to_numpy(given))) for given in called]
    assert smallest[0] == -1.0 and smallest[1] >= 0.0 and len(smallest) == 2
    sequential = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, name="compat_graph_seq_dense")]
    )
    assert [node.operation.name for node in compat.graph_calls(sequential)] == [
        "compat_graph_seq_dense"
    ], f"{VERSIONS}: Sequential._functional changed"

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    class OwnCall(keras.Model):  # Functional, with a call of its own.
        def call(self, x):
            return x

    own_call = OwnCall(inputs, hidden, name="compat_graph_own_call")
    for graphless in (Subclassed(name="compat_graph_sub"), own_call, shared):
        assert compat.graph_calls(graphless) is None


@pytest.mark.parametrize("name", compat.__all__)
def test_each_touch_is_documented(name):
    """The package docstring lists each touch under the module holding it."""
    assert f"`{name}`" in compat.__doc__


def test_dataset_inputs_walks_a_pipeline_down_to_its_source():
    """Written for TensorFlow 2.21: `DatasetV2._inputs` lists what a dataset transforms."""
    source = tf.data.Dataset.range(8)
    batched = source.batch(2)
    zipped = tf.data.Dataset.zip((batched, source))
    assert compat.dataset_inputs(source) == [], VERSIONS
    assert compat.dataset_inputs(batched) == [source], VERSIONS
    assert compat.dataset_inputs(zipped) == [batched, source], VERSIONS


def test_op_determinism_is_on_in_the_block_and_as_it_was_after():
    """Written for TensorFlow 2.21: `tensorflow.python.framework.config` has the inverse."""
    from tensorflow.python.framework import config as tf_config

    from mpt_keras.compat import determinism

    assert not tf_config.is_op_determinism_enabled(), VERSIONS
    with determinism.op_determinism(True):
        assert tf_config.is_op_determinism_enabled(), VERSIONS
    assert not tf_config.is_op_determinism_enabled(), VERSIONS
    with determinism.op_determinism(False):
        assert not tf_config.is_op_determinism_enabled(), VERSIONS

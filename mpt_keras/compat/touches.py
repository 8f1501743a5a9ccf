"""Every touch of a private Keras name in the package, and two of private TensorFlow ones.

Keras and TensorFlow offer no public way to do a few things the package needs;
each is wrapped here, in one place, so that a Keras upgrade that breaks one
fails one test of `tests/test_compat.py` with a message naming the Keras
version, rather than a training run somewhere else. `check()` lists the names
this Keras no longer has.

The loss-scale optimizer's touches:

- `maybe_merge_call`: TensorFlow's `tf.__internal__.distribute.interim.
  maybe_merge_call`, which Keras' own optimizers use to leave the replica
  context for the cross-replica one (a `merge_call` where the strategy needs
  one).
- `gradients_already_reduced`: Keras' TensorFlow optimizer sums each
  gradient across replicas inside `apply()` (`TFOptimizer.
  _all_reduce_sum_gradients`). The loss-scale optimizer has summed them
  before (to judge and clip the sum), so while it runs the inner optimizer's
  `apply()` that sum must be the identity. `install()` wraps the method once,
  at import; the wrapper reads a flag that only this context manager sets.
- `called_cond`: a `tf.cond` whose `If` op gets TensorFlow's private
  attribute `_lower_using_switch_merge=False`: it runs as one function call. The
  default lowering gives the cond a Switch op per tensor and variable it
  captures, about 40 for a small MLP's Adam update, which on CPU costs more
  than the call: 4% of a 0.55 ms step, measured with
  `benchmarks.stack_ablation`.
- `skip_stock_build`: `keras.optimizers.Optimizer.build`, called past the
  stock `LossScaleOptimizer.build` (which would make a second scale variable).

The compile hook's (`autoscale`):

- `keras_trainer_class`: Keras' `Trainer`, whose `compile` the hook replaces:
  Keras compiles a model it loads from a file only if `type(model).compile`
  is `Trainer.compile`, so replacing `keras.Model.compile` would not do.

The XLA train step's (`xla`), which is Keras' own TensorFlow train step
rebuilt around the loss-scale optimizer:

- `compile_config`: `model._compile_config`, a new object at each
  `model.compile`, which tells that the model was compiled again since.
- `call_has_training_arg` and `compute_loss`: as Keras' step, pass
  `training` only to models whose `call` takes it, and reach `compute_loss`
  overrides written without a `training` argument.
- `reduce_per_replica`: how Keras' train function reduces the step's
  outputs over replicas, for the train function of `train_function`, which
  leaves out Keras' per-step Optional.
- `loss_tracker` and `unscale_loss_for_distribution`: the `loss` metric, and
  the per-replica loss undone back to the model's loss before it is tracked.

The layers' (`precision.manifest`, `calibration`, `layer_paths`, `parity_rows`):

- `replace_dtype_policy`: the public `dtype_policy` setter writes into a
  `DTypePolicyMap` the layer holds (after an earlier apply, or loading)
  instead of replacing it.
- `direct_sublayers`: Keras tracks a layer's sublayers, in order, but lists
  only a model's top-level ones (`model.layers`), not any layer's.
- `producing_layer` and `producing_node`: the edges of a functional model's
  graph (which call of which layer made a tensor, on what inputs), for which
  Keras has no public accessor.
- `graph_calls`: the calls a functional or Sequential model's `call` runs
  from its graph, in the order it runs them (`parity_rows` counts each
  layer's calls to tell which call of a shared layer it watches).

The data check's (`data.sources`):

- `dataset_inputs`: the datasets a `tf.data.Dataset` transforms, to find a
  `.batch()` in a data factory's pipeline (TensorFlow 2.21).

The optimizer's (`runs`):

- `learning_rate_schedule`: the learning rate an optimizer was given, where
  `optimizer.learning_rate` evaluates a schedule at the current step.

Multi-worker `fit` (`distribute`, working around keras-team/keras#20585):

- `symbolic_build`, `replace_maybe_symbolic_build` and
  `restore_maybe_symbolic_build`: the build Keras' `fit` and `evaluate` do
  before the first step, which under a multi-worker strategy must build from
  the first replica's batch (and as Keras does again after a re-compile).
- `in_multi_worker_mode`: whether a strategy spans several workers (a
  `MultiWorkerMirroredStrategy` without a cluster runs on one).

The precision report's (`precision.report`), which traces a model once:

- `call_records_restored`: what a call records on a layer (`_called`,
  `_parent_path`, the losses of the last call), put back as it was before
  the trace.

Why one module: its size is the list above. Keeping every private touch
here is the point: one file to read, and one test file to run, when Keras
changes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

# Read from every replica's thread while one thread traces the inner update:
# a plain global under a lock, not a thread-local.
_LOCK = threading.Lock()
_REDUCED_DEPTH = 0
_INSTALLED = False
_LOWERING_ATTR = "_lower_using_switch_merge"


def _tf_optimizer_class() -> type:
    """Keras' TensorFlow optimizer base class (private module)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def _keras_loss_module() -> Any:
    """Keras' module of the loss base class and its helpers (private module)."""
    return importlib.import_module("keras.src.losses.loss")


def maybe_merge_call(fn: Callable[..., Any], strategy: tf.distribute.Strategy, *args: Any) -> Any:
    """Calls `fn(strategy, *args)` in the cross-replica context, as Keras' optimizers do."""
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def called_cond(pred: Any, true_fn: Callable[[], None], false_fn: Callable[[], None]) -> None:
    """Runs `true_fn` or `false_fn` (each returns nothing), as one function call in a graph.

    Under a strategy with several local devices it is a plain `tf.cond`: a
    function call cannot place a branch that writes variables on several
    devices. Eagerly, the chosen branch simply runs.
    """
    if tf.executing_eagerly():
        (true_fn if bool(pred) else false_fn)()
        return
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    tf.cond(pred, true_fn, false_fn)
    if (
        tf.distribute.has_strategy()
        and len(tf.distribute.get_strategy().extended.worker_devices) > 1
    ):
        return
    for op in graph.get_operations()[known:]:
        if op.type in ("If", "StatelessIf"):
            op._set_attr(_LOWERING_ATTR, tf.compat.v1.AttrValue(b=False))


def install() -> None:
    """Wraps `TFOptimizer._all_reduce_sum_gradients` once, for `gradients_already_reduced`."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        cls = _tf_optimizer_class()
        original = cls._all_reduce_sum_gradients

        @functools.wraps(original)
        def all_reduce_sum_gradients(self: Any, grads_and_vars: Any) -> Any:
            if _REDUCED_DEPTH:
                return list(grads_and_vars)
            return original(self, grads_and_vars)

        cls._all_reduce_sum_gradients = all_reduce_sum_gradients
        _INSTALLED = True


@contextlib.contextmanager
def gradients_already_reduced() -> Iterator[None]:
    """While tracing inside it, Keras' optimizers do not all-reduce their gradients again."""
    global _REDUCED_DEPTH
    install()
    with _LOCK:
        _REDUCED_DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _REDUCED_DEPTH -= 1


def skip_stock_build(optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> None:
    """`keras.optimizers.Optimizer.build`: the base build, past the stock loss-scale one."""
    keras.optimizers.Optimizer.build(optimizer, var_list)


def keras_trainer_class() -> type:
    """Keras' private `Trainer` class, whose `compile` every `keras.Model` runs.

    The compile hook replaces `Trainer.compile` itself, not
    `keras.Model.compile`: Keras compiles a model it loads from a file only if
    `type(model).compile` is `Trainer.compile` (`Trainer.compile_from_config`).

    Returns:
        `keras.src.trainers.trainer.Trainer`.
    """
    from keras.src.trainers.trainer import Trainer

    return Trainer


def compile_config(model: keras.Model) -> Any:
    """The config of `model`'s last `compile`, a new object at each compile.

    Keras has no public sign that a model was compiled again: the XLA train
    step compares this object's identity with the one it was made for.

    Args:
        model: A compiled model.

    Returns:
        `model._compile_config`.
    """
    return model._compile_config


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes a `training` argument.

    Keras' train step passes `training=True` only to such models; the XLA
    train step does as it does.

    Args:
        model: A model.

    Returns:
        `model._call_has_training_arg`.
    """
    return model._call_has_training_arg


def compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool = True
) -> Any:
    """`model.compute_loss`, also where an override of it takes no `training` argument.

    Keras' train step calls `compute_loss` through this private wrapper,
    which drops `training` for such overrides; the XLA train step does too.

    Args:
        model: A compiled model.
        x: The batch's inputs.
        y: The batch's targets.
        y_pred: What `model` predicted for `x`.
        sample_weight: The batch's sample weights, or None.
        training: Whether the loss is for a training step.

    Returns:
        The loss, as `model._compute_loss` returns it.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def _tf_trainer_module() -> Any:
    """Keras' TensorFlow trainer module (private)."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def reduce_per_replica(outputs: Any, strategy: tf.distribute.Strategy) -> Any:
    """Keras' reduction of a train step's per-replica outputs, as its own train function does.

    Args:
        outputs: What `strategy.run(model.train_step, ...)` returned.
        strategy: The model's strategy.

    Returns:
        `reduce_per_replica(outputs, strategy, reduction="auto")`: the mean
        over replicas (the first replica's under a TPU strategy).
    """
    return _tf_trainer_module().reduce_per_replica(outputs, strategy, reduction="auto")


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    """The metric behind the `loss` that `fit` reports, which a train step updates.

    Keras updates it in its own train step and offers no public handle to it;
    the XLA train step, which replaces Keras', must update it too.

    Args:
        model: A compiled model.

    Returns:
        `model._loss_tracker`.
    """
    return model._loss_tracker


def unscale_loss_for_distribution(loss: Any) -> Any:
    """`loss` times the number of replicas in sync, as Keras' train step tracks it.

    Keras' losses divide by the number of replicas so that the gradients
    summed over them average; the tracked loss undoes that division.

    Args:
        loss: One replica's loss, as `compute_loss` returns it.

    Returns:
        `keras.src.losses.loss.unscale_loss_for_distribution(loss)`.
    """
    return _keras_loss_module().unscale_loss_for_distribution(loss)


def learning_rate_schedule(optimizer: keras.optimizers.Optimizer) -> Any:
    """The learning rate `optimizer` was given: the schedule itself, if it is one.

    `optimizer.learning_rate` gives a schedule's value at the current step
    instead, so a schedule's own state (`ScaledLearningRate.scale`) is only
    reachable here.

    Args:
        optimizer: A Keras optimizer.

    Returns:
        `optimizer._learning_rate`.
    """
    return optimizer._learning_rate


def replace_dtype_policy(layer: keras.layers.Layer, policy: keras.DTypePolicy) -> None:
    """Gives `layer` the dtype policy `policy` itself.

    The public `dtype_policy` setter writes into a `DTypePolicyMap` the layer
    already holds (after an earlier apply, or loading) instead of replacing it.

    Args:
        layer: A layer.
        policy: The policy it computes and keeps its variables in from now on.
    """
    layer._dtype_policy = policy


def direct_sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers `layer` tracks directly, in the order it tracked them.

    Keras lists them only for models (`model.layers`, top level only), not for
    other layers that hold sublayers (attention projections, blocks).

    Args:
        layer: A layer or model.

    Returns:
        `layer._flatten_layers(include_self=False, recursive=False)`.
    """
    return layer._flatten_layers(include_self=False, recursive=False)


def producing_layer(tensor: keras.KerasTensor) -> keras.layers.Layer:
    """The layer (or operation) whose call made the symbolic `tensor`.

    Keras has no public accessor to the graph of a functional model.

    Args:
        tensor: A symbolic tensor of a functional model.

    Returns:
        `tensor._keras_history.operation`.
    """
    return tensor._keras_history.operation


def producing_node(tensor: keras.KerasTensor) -> Any:
    """The call (node) of its layer that made the symbolic `tensor`.

    Its `input_tensors` are what that call took: a layer called twice has a
    node per call. Keras has no public accessor to the graph.

    Args:
        tensor: A symbolic tensor of a functional model.

    Returns:
        The node `tensor._keras_history` names.
    """
    history = tensor._keras_history
    return history.operation._inbound_nodes[history.node_index]


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Builds `model`, its compiled metrics and loss, and its optimizer, from one batch.

    This is the build Keras' `fit` and `evaluate` do before the first step
    (only the batch's shapes and dtypes are used).

    Args:
        model: A compiled model.
        data_batch: One batch, `(x, y)` or `(x, y, sample_weight)`.
    """
    model._symbolic_build(data_batch=data_batch)


def replace_maybe_symbolic_build(model: keras.Model, build: Callable[..., None]) -> None:
    """Makes `model`'s `fit` and `evaluate` call `build` to build the model.

    Keras' TensorFlow trainer calls `model._maybe_symbolic_build(iterator=...)`
    before the first step; under a multi-worker strategy its own reduces a
    whole batch across workers and fails (keras-team/keras#20585).

    Args:
        model: A model.
        build: Called as `build(iterator=None, data_batch=None)`.
    """
    model._maybe_symbolic_build = build


def restore_maybe_symbolic_build(model: keras.Model) -> None:
    """Undoes `replace_maybe_symbolic_build`: `fit` builds `model` as Keras does.

    Args:
        model: A model, with its build replaced or not.
    """
    vars(model).pop("_maybe_symbolic_build", None)


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` runs on several workers.

    TensorFlow tells only through a private method of `strategy.extended`; a
    `MultiWorkerMirroredStrategy` with no cluster configured runs on one.

    Args:
        strategy: A tf.distribute strategy.

    Returns:
        `strategy.extended._in_multi_worker_mode()`.
    """
    return strategy.extended._in_multi_worker_mode()


@contextlib.contextmanager
def call_records_restored(layers: Iterable[keras.layers.Layer]) -> Iterator[None]:
    """Puts back, on exit (even on error), what calls in the block record on each layer.

    A layer's first call sets `_called` (which Keras' export reads: whether a
    subclassed model was called) and `_parent_path` (the name scope it makes
    variables in later); a model's call clears the losses of the last call
    (`model.losses`) in every layer, and adds its own.

    Args:
        layers: The layers (a model included) to restore.
    """
    kept = [(layer, layer._called, layer._parent_path, list(layer._losses)) for layer in layers]
    try:
        yield
    finally:
        for layer, called, parent_path, losses in kept:
            layer._called = called
            layer._parent_path = parent_path
            layer._losses[:] = losses


def check() -> list[str]:
    """The names touched above that this Keras or TensorFlow no longer has.

    Builds and compiles a one-layer functional model to find the attributes
    Keras sets on instances, naming every object so that none takes a name
    Keras would give an unnamed one.

    Returns:
        One entry per missing name; empty when all are there.
    """
    problems = []

    def require(
        owner: Any, label: str, methods: Sequence[str] = (), attributes: Sequence[str] = ()
    ) -> None:
        problems.extend(
            f"{label}.{name}" for name in methods if not callable(getattr(owner, name, None))
        )
        problems.extend(f"{label}.{name}" for name in attributes if not hasattr(owner, name))

    for label, load, methods in (
        (
            "keras.src.backend.tensorflow.optimizer.TFOptimizer",
            _tf_optimizer_class,
            ["_all_reduce_sum_gradients"],
        ),
        ("keras.src.trainers.trainer.Trainer", keras_trainer_class, ["compile"]),
        ("keras.src.losses.loss", _keras_loss_module, ["unscale_loss_for_distribution"]),
        ("keras.src.backend.tensorflow.trainer", _tf_trainer_module, ["reduce_per_replica"]),
    ):
        try:
            require(load(), label, methods)
        except ImportError as error:
            problems.append(f"{label}: {error}")
    interim = getattr(getattr(tf.__internal__, "distribute", None), "interim", None)
    require(interim, "tf.__internal__.distribute.interim", ["maybe_merge_call"])
    extended = tf.distribute.StrategyExtended
    require(extended, "tf.distribute.StrategyExtended", ["_in_multi_worker_mode"])
    require(
        keras.Model,
        "keras.Model",
        ["_compute_loss", "_symbolic_build", "_maybe_symbolic_build", "_flatten_layers"],
    )

    inputs = keras.Input((1,), name="keras_compat_check_input")
    layer = keras.layers.Dense(1, name="keras_compat_check_dense")
    model = keras.Model(inputs, layer(inputs), name="keras_compat_check")
    optimizer = keras.optimizers.SGD(name="keras_compat_check_sgd")
    model.compile(optimizer, loss=keras.losses.MeanSquaredError(name="keras_compat_check_mse"))
    require(
        model,
        "compiled model",
        attributes=["_compile_config", "_loss_tracker", "_call_has_training_arg"],
    )
    require(optimizer, "optimizer", attributes=["_learning_rate"])
    require(layer, "layer", attributes=["_dtype_policy", "_inbound_nodes"])
    require(layer, "layer", attributes=["_called", "_parent_path", "_losses"])
    require(model.outputs[0], "symbolic tensor", attributes=["_keras_history"])
    require(model, "functional model", attributes=["_nodes_by_depth"])
    return problems


def graph_calls(model: keras.Model) -> list[Any] | None:
    """The calls (nodes) `model`'s own `call` runs from its graph, in the order it runs them.

    Keras runs a functional model's graph by depth, the deepest first
    (`Function._run_through_graph`), a built Sequential model's through the
    functional model it holds (`_functional`); neither the order nor the
    graph of a Sequential model is public.

    Args:
        model: A model or layer.

    Returns:
        The nodes of `_nodes_by_depth` from the deepest depth to 0, without
        input nodes; None where `model`'s call does not run a graph: a layer,
        a subclassed model, a functional subclass with a `call` of its own,
        or a Sequential model Keras built no graph for.
    """
    functional = importlib.import_module("keras.src.models.functional").Functional
    if isinstance(model, keras.Sequential):
        graph = model._functional if type(model).call is keras.Sequential.call else None
    elif isinstance(model, functional) and type(model).call is functional.call:
        graph = model
    else:
        graph = None
    if graph is None:
        return None
    by_depth = graph._nodes_by_depth
    return [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if node.operation is not None and not node.is_input
    ]


def dataset_inputs(dataset: Any) -> list[Any]:
    """The datasets a `tf.data.Dataset` transforms (none for a source).

    tf.data keeps a pipeline's chain (`DatasetV2._inputs`, TensorFlow 2.21)
    but offers no public way to read it; the data check walks it to find a
    `.batch()` in a data factory's pipeline.
    """
    return list(dataset._inputs())

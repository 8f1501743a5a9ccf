"""The inventory of touched names: `check()` lists those this Keras or TensorFlow lacks."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from mpt_keras.compat.jax_trainer import jax_trainer_class
from mpt_keras.compat.optimizers import tf_optimizer_class
from mpt_keras.compat.trainer import keras_loss_module, keras_trainer_class, tf_trainer_module


def check() -> list[str]:
    """The touched names this Keras or TensorFlow no longer has; empty when all are there.

    Compiles a one-layer model, every object named (so no made-up name is taken).
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
            tf_optimizer_class,
            ["_all_reduce_sum_gradients"],
        ),
        ("keras.src.trainers.trainer.Trainer", keras_trainer_class, ["compile"]),
        ("keras.src.losses.loss", keras_loss_module, ["unscale_loss_for_distribution"]),
        ("keras.src.backend.tensorflow.trainer", tf_trainer_module, ["reduce_per_replica"]),
    ):
        try:
            require(load(), label, methods)
        except ImportError as error:
            problems.append(f"{label}: {error}")
    with contextlib.suppress(ImportError):  # No JAX here: its trainer is touched on JAX only.
        require(
            jax_trainer_class(),
            "keras.src.backend.jax.trainer.JAXTrainer",
            ["_update_metrics_variables", "_get_jax_state", "jax_state_sync"],
        )
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

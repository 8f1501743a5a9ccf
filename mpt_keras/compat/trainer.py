"""Touches of Keras' trainer: the compile hook's, the XLA train step's (a rebuild of Keras'
own, so it reaches what that reaches) and multi-worker `fit`'s."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras

if TYPE_CHECKING:
    import tensorflow as tf


def keras_loss_module() -> Any:
    return importlib.import_module("keras.src.losses.loss")


def tf_trainer_module() -> Any:
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def keras_trainer_class() -> type:
    """Keras' private `Trainer`, whose `compile` the compile hook replaces (not `Model`'s:
    Keras compiles a loaded model only if `type(model).compile` is `Trainer.compile`)."""
    from keras.src.trainers.trainer import Trainer

    return Trainer


def compile_config(model: keras.Model) -> Any:
    """A new object at each `compile`: the only sign of a re-compile."""
    return model._compile_config


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes `training` (Keras' step passes it only then; so does ours)."""
    return model._call_has_training_arg


def compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool = True
) -> Any:
    """`model.compute_loss` through Keras' wrapper, which serves overrides without `training`."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def reduce_per_replica(outputs: Any, strategy: tf.distribute.Strategy) -> Any:
    """Keras' reduction of a step's per-replica outputs: the mean (a TPU's: the first replica's)."""
    return tf_trainer_module().reduce_per_replica(outputs, strategy, reduction="auto")


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    """The metric behind `fit`'s `loss` (the XLA step updates it in Keras' stead)."""
    return model._loss_tracker


def unscale_loss_for_distribution(loss: Any) -> Any:
    """`loss` times the replicas in sync: Keras' losses divide by it, its tracked loss does not."""
    return keras_loss_module().unscale_loss_for_distribution(loss)


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Builds `model`, its metrics, loss and optimizer from one batch's specs, as `fit` does."""
    model._symbolic_build(data_batch=data_batch)


def replace_maybe_symbolic_build(model: keras.Model, build: Callable[..., None]) -> None:
    """Makes `fit` and `evaluate` build `model` by `build(iterator=None, data_batch=None)`;
    Keras' own fails under a multi-worker strategy (keras-team/keras#20585)."""
    model._maybe_symbolic_build = build


def restore_maybe_symbolic_build(model: keras.Model) -> None:
    """Undoes `replace_maybe_symbolic_build` (replaced or not): `fit` builds as Keras does."""
    vars(model).pop("_maybe_symbolic_build", None)


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` spans several workers (an unconfigured multi-worker one does not)."""
    return strategy.extended._in_multi_worker_mode()

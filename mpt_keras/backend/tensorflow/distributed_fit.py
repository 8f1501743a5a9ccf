"""Keras 3's `fit` and `evaluate` under a tf.distribute strategy, where they fail unpatched.

Keras 3.15 `strategy.reduce`s a whole batch to build the model (keras-team/keras#20585), at
every `fit` even when all is built: a bool input, as keras_hub's `padding_mask`, cannot be
summed (TensorFlow's AddN refuses bool, under MirroredStrategy too), and multi-worker
reductions fail outright. Under a multi-worker strategy it also reduces each scalar step output
with `axis=0`.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.backend.tensorflow.multi_worker import in_multi_worker_mode


def support_distributed_fit(model: keras.Model) -> None:
    """Lets `fit` and `evaluate` run under a tf.distribute strategy; call after compiling,
    inside the strategy's scope.

    Builds from the first replica's batch; under a multi-worker strategy also gives the steps'
    scalar outputs a length-1 axis the reduction averages back to a scalar. A no-op without a
    strategy, where Keras builds as the step is traced.
    """
    if not tf.distribute.has_strategy():
        return
    strategy = model.distribute_strategy

    def first_replica(value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(iterator: Any = None, data_batch: Any = None) -> None:
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
        with strategy.scope():
            compat.symbolic_build(model, keras.tree.map_structure(first_replica, data_batch))

    def with_replica_axis(step: Any) -> Any:
        def step_with_replica_axis(data: Any) -> Any:
            return keras.tree.map_structure(
                lambda value: tf.reshape(value, [1]) if value.shape.rank == 0 else value,
                step(data),
            )

        return step_with_replica_axis

    compat.replace_maybe_symbolic_build(model, maybe_symbolic_build)
    if not in_multi_worker_mode(strategy):
        return
    model.train_step = with_replica_axis(model.train_step)
    model.test_step = with_replica_axis(model.test_step)

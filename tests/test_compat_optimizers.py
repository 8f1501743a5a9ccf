"""Tests of mpt_keras.compat.optimizers that reach its private state: the all-reduce wrapper.

Each fails with a message naming the Keras and TensorFlow versions.
"""

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.compat import optimizers

VERSIONS = f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def test_gradients_already_reduced_makes_keras_all_reduce_the_identity():
    """Inside a 2-replica strategy, Keras' own all-reduce would double the sum."""
    optimizer = keras.optimizers.SGD(1.0)
    gradient = tf.constant([1.0, 2.0])
    variable = keras.Variable([0.0, 0.0])
    strategy = tf.distribute.get_strategy()

    def replica_sum(already_reduced: bool) -> list:
        def step():
            if already_reduced:
                with optimizers.gradients_already_reduced():
                    return optimizer._all_reduce_sum_gradients([(gradient, variable)])
            return optimizer._all_reduce_sum_gradients([(gradient, variable)])

        return strategy.extended.call_for_each_replica(step)

    with strategy.scope():
        kept = replica_sum(already_reduced=True)
    assert kept[0][0] is gradient, f"{VERSIONS}: the all-reduce wrapper no longer passes through"
    assert optimizers._REDUCED_DEPTH == 0
    # Outside the context the original runs (the default strategy: identity too).
    np.testing.assert_array_equal(replica_sum(already_reduced=False)[0][0], [1.0, 2.0])


def test_install_wraps_once():
    optimizers.install()
    cls = optimizers.tf_optimizer_class()
    wrapped = cls._all_reduce_sum_gradients
    optimizers.install()
    assert cls._all_reduce_sum_gradients is wrapped
    assert wrapped.__wrapped__.__name__ == "_all_reduce_sum_gradients", (
        f"{VERSIONS}: TFOptimizer._all_reduce_sum_gradients changed"
    )

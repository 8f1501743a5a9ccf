"""Tests of mpt_keras._keras_compat: one per private Keras or TensorFlow touch.

Each fails with a message naming the Keras and TensorFlow versions, so that an
upgrade that breaks a touch says which one, here, before a training run does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras import _keras_compat as compat

VERSIONS = f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def test_every_touched_name_is_there():
    assert compat.check() == [], f"{VERSIONS} no longer has: {compat.check()}"


def test_maybe_merge_call_calls_with_the_strategy_outside_a_strategy():
    strategy = tf.distribute.get_strategy()
    assert compat.maybe_merge_call(lambda s, x: (s, x + 1), strategy, 1) == (strategy, 2), (
        f"{VERSIONS}: maybe_merge_call changed"
    )


def test_gradients_already_reduced_makes_keras_all_reduce_the_identity():
    """Inside a 2-replica strategy, Keras' own all-reduce would double the sum."""
    optimizer = keras.optimizers.SGD(1.0)
    gradient = tf.constant([1.0, 2.0])
    variable = keras.Variable([0.0, 0.0])
    strategy = tf.distribute.get_strategy()

    def replica_sum(already_reduced: bool) -> list:
        def step():
            if already_reduced:
                with compat.gradients_already_reduced():
                    return optimizer._all_reduce_sum_gradients([(gradient, variable)])
            return optimizer._all_reduce_sum_gradients([(gradient, variable)])

        return strategy.extended.call_for_each_replica(step)

    with strategy.scope():
        kept = replica_sum(already_reduced=True)
    assert kept[0][0] is gradient, f"{VERSIONS}: the all-reduce wrapper no longer passes through"
    assert compat._REDUCED_DEPTH == 0
    # Outside the context the original runs (the default strategy: identity too).
    np.testing.assert_array_equal(replica_sum(already_reduced=False)[0][0], [1.0, 2.0])


def test_install_wraps_once():
    compat.install()
    cls = compat._tf_optimizer_class()
    wrapped = cls._all_reduce_sum_gradients
    compat.install()
    assert cls._all_reduce_sum_gradients is wrapped
    assert wrapped.__wrapped__.__name__ == "_all_reduce_sum_gradients", (
        f"{VERSIONS}: TFOptimizer._all_reduce_sum_gradients changed"
    )


def test_skip_stock_build_builds_the_base_optimizer_only():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    variable = keras.Variable([0.0])
    compat.skip_stock_build(optimizer, [variable])
    assert optimizer.built
    assert not hasattr(optimizer, "dynamic_scale"), f"{VERSIONS}: the stock build ran"


@pytest.mark.parametrize(
    "name", ["maybe_merge_call", "gradients_already_reduced", "skip_stock_build"]
)
def test_each_touch_is_documented(name):
    assert f"`{name}`" in compat.__doc__

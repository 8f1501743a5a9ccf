"""The loss-scale optimizer's touches of Keras' optimizer internals and TensorFlow's merge_call."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

# Read from every replica's thread: a global under a lock, not a thread-local.
_LOCK = threading.Lock()
_REDUCED_DEPTH = 0
_INSTALLED = False
_LOWERING_ATTR = "_lower_using_switch_merge"


def tf_optimizer_class() -> type:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def maybe_merge_call(fn: Callable[..., Any], strategy: tf.distribute.Strategy, *args: Any) -> Any:
    """Calls `fn(strategy, *args)` in the cross-replica context, as Keras' optimizers do."""
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def called_cond(pred: Any, true_fn: Callable[[], None], false_fn: Callable[[], None]) -> None:
    """Runs `true_fn` or `false_fn` (each returns nothing), as one function call in a graph.

    The default lowering adds a Switch op per captured tensor (about 40 for a small MLP's
    Adam update: 4% of a 0.55 ms CPU step, `benchmarks.stack_ablation`). Lowered still on
    several local devices: a call cannot place a branch writing on several.
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
        cls = tf_optimizer_class()
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
    """Inside it, Keras' optimizers do not all-reduce again the gradients ours has summed."""
    global _REDUCED_DEPTH
    install()
    with _LOCK:
        _REDUCED_DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _REDUCED_DEPTH -= 1

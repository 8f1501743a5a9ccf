"""Every touch of a private Keras or TensorFlow name that the loss-scaling step makes.

Keras and TensorFlow offer no public way to do a few things the loss-scale
optimizer needs; each is wrapped here, in one place, so that a Keras upgrade
that breaks one fails one test of `tests/test_keras_compat.py` with a message
naming the Keras version, rather than a training run somewhere else.

The touches:

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
- `skip_stock_build`: `keras.optimizers.Optimizer.build`, called past the
  stock `LossScaleOptimizer.build` (which would make a second scale variable).

The rest of the package's private touches (`model._compile_config` and the
like) are listed in the module that makes them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

# Read from every replica's thread while one thread traces the inner update:
# a plain global under a lock, not a thread-local.
_LOCK = threading.Lock()
_REDUCED_DEPTH = 0
_INSTALLED = False


def _tf_optimizer_class() -> type:
    """Keras' TensorFlow optimizer base class (private module)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def maybe_merge_call(fn: Callable[..., Any], strategy: tf.distribute.Strategy, *args: Any) -> Any:
    """Calls `fn(strategy, *args)` in the cross-replica context, as Keras' optimizers do."""
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


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


def check() -> list[str]:
    """What this Keras no longer has of the touches above (empty when all are there)."""
    problems = []
    try:
        cls = _tf_optimizer_class()
    except ImportError as error:
        return [f"keras.src.backend.tensorflow.optimizer.TFOptimizer: {error}"]
    if not callable(getattr(cls, "_all_reduce_sum_gradients", None)):
        problems.append("TFOptimizer._all_reduce_sum_gradients")
    interim = getattr(getattr(tf.__internal__, "distribute", None), "interim", None)
    if not callable(getattr(interim, "maybe_merge_call", None)):
        problems.append("tf.__internal__.distribute.interim.maybe_merge_call")
    return problems

"""The function `fit` calls for each train step, without Keras' per-step Optional.

Keras' Optional, unwrapped by two eager ops, costs 17% of the reference MLP's 0.55 ms step,
~2% more per further scalar (`benchmarks.stack_ablation`, 2 EPYC cores). This one calls
`iterator.get_next()` inside; the data's end raises `OutOfRangeError`, which Keras' epoch
iterator takes as the end too. Keras' own stays for `steps_per_execution` > 1,
`run_eagerly`, `train_on_batch`, multi-worker (all must agree on the end) and recompiles.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from mpt_keras import compat


def install(model: keras.Model) -> None:
    """Makes `model.make_train_function` give this function; call after compiling."""
    compiled_with = compat.compile_config(model)
    keras_make = type(model).make_train_function

    def make_train_function(force: bool = False) -> Any:
        if model.train_function is not None and not force:
            return model.train_function
        keras_make(model, force)
        if (
            compat.compile_config(model) is compiled_with
            and model.steps_per_execution == 1
            and not model.run_eagerly
            and not compat.in_multi_worker_mode(model.distribute_strategy)
        ):
            model.train_function = _direct(model, model.train_function)
        return model.train_function

    model.make_train_function = make_train_function
    model.train_function = None


def _direct(model: keras.Model, keras_function: Any) -> Any:
    """One step on the iterator's next batch, outputs as returned."""
    strategy = model.distribute_strategy

    # No autograph, as Keras' own step (`do_not_convert`): converting our step's code costs
    # seconds per trace, and nothing in it needs converting.
    @tf.function(reduce_retracing=True, autograph=False)
    def step_on_iterator(iterator: Any) -> Any:
        data = iterator.get_next()
        # As Keras: an empty Optional in the batch (a missing part) is None.
        data = keras.tree.map_structure(
            lambda part: None if isinstance(part, tf.experimental.Optional) else part, data
        )
        outputs = strategy.run(model.train_step, args=(data,))
        return compat.reduce_per_replica(outputs, strategy)

    first_call = True

    def train_function(iterator: Any) -> Any:
        nonlocal first_call
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            if first_call:
                first_call = False
                _build_before_tracing(model, iterator)
            return step_on_iterator(iterator)
        return keras_function(iterator)

    return train_function


def _build_before_tracing(model: keras.Model, iterator: Any) -> None:
    """Builds the compiled metrics from the batch's specs before the step is traced.

    Without a strategy Keras builds them inside the first trace, and a `tf.function` whose
    first trace creates variables is traced again: the whole step twice (the tiny
    Transformer's validation: 4 traces for 2 models). Keras' own build under a strategy
    (`compat.symbolic_build`) does it from specs, at the cost of one forward pass traced.
    A model that cannot be built from specs is left to its first trace, as before.
    """
    if not isinstance(iterator, tf.data.Iterator):  # Under a strategy, Keras has built it.
        return
    spec = iterator.element_spec
    if not all(isinstance(leaf, tf.TensorSpec) for leaf in keras.tree.flatten(spec)):
        return
    try:
        compat.symbolic_build(model, spec)
    except Exception:  # The first trace builds it, as without this.
        return

"""Every touch of a private Keras, TensorFlow or TFDS name, each tested for the versions we pin.

The package calls these (`from mpt_keras import compat`), never a private name itself; each
loads on first use, so that a JAX process never imports the TensorFlow ones;
`tests/test_compat*.py` fail naming the version when one moves, and `check()` lists the
names this Keras no longer has.

    optimizers.py     `maybe_merge_call`, `called_cond`, `gradients_already_reduced`
                      (after `install`): TensorFlow's
    keras_optimizers.py  `skip_stock_build`, `learning_rate_schedule`: every backend's
    trainer.py        `keras_trainer_class` (the compile hook); `compile_config`,
                      `call_has_training_arg`, `compute_loss`, `reduce_per_replica`,
                      `loss_tracker`, `unscale_loss_for_distribution` (the XLA step);
                      `symbolic_build`, `replace_maybe_symbolic_build`,
                      `restore_maybe_symbolic_build`, `in_multi_worker_mode`
    layers.py         `replace_dtype_policy`, `direct_sublayers`, `producing_layer`,
                      `producing_node`, `runs_graph`, `graph_calls`,
                      `call_records_restored`
    jax_trainer.py    `update_metrics_variables` (the JAX loss-scaling train step),
                      `stateless_value`, `fit_train_step` (`fit`'s step, for mpt-bench)
    data.py           `dataset_inputs`: the chain of a tf.data pipeline
    inventory.py      `check`: the touched names this Keras or TensorFlow lacks
    tf_distribute.py  TensorFlow's coordination service (multi-worker heartbeats)
    tfds_progress.py  TFDS's progress-bar switch
    determinism.py    `op_determinism`: TensorFlow's op determinism, on and back off
                      (these three are imported from their modules, not re-exported)
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; loaded lazily below
    from mpt_keras.compat.data import dataset_inputs
    from mpt_keras.compat.inventory import check
    from mpt_keras.compat.jax_trainer import stateless_value, update_metrics_variables
    from mpt_keras.compat.keras_optimizers import learning_rate_schedule, skip_stock_build
    from mpt_keras.compat.layers import (
        call_records_restored,
        direct_sublayers,
        graph_calls,
        producing_layer,
        producing_node,
        replace_dtype_policy,
        runs_graph,
    )
    from mpt_keras.compat.optimizers import (
        called_cond,
        gradients_already_reduced,
        install,
        maybe_merge_call,
    )
    from mpt_keras.compat.trainer import (
        call_has_training_arg,
        compile_config,
        compute_loss,
        in_multi_worker_mode,
        keras_trainer_class,
        loss_tracker,
        reduce_per_replica,
        replace_maybe_symbolic_build,
        restore_maybe_symbolic_build,
        symbolic_build,
        unscale_loss_for_distribution,
    )

_HOMES = {
    "call_has_training_arg": "trainer",
    "call_records_restored": "layers",
    "called_cond": "optimizers",
    "check": "inventory",
    "compile_config": "trainer",
    "compute_loss": "trainer",
    "dataset_inputs": "data",
    "direct_sublayers": "layers",
    "gradients_already_reduced": "optimizers",
    "graph_calls": "layers",
    "in_multi_worker_mode": "trainer",
    "install": "optimizers",
    "keras_trainer_class": "trainer",
    "learning_rate_schedule": "keras_optimizers",
    "loss_tracker": "trainer",
    "maybe_merge_call": "optimizers",
    "producing_layer": "layers",
    "producing_node": "layers",
    "reduce_per_replica": "trainer",
    "replace_dtype_policy": "layers",
    "replace_maybe_symbolic_build": "trainer",
    "restore_maybe_symbolic_build": "trainer",
    "runs_graph": "layers",
    "skip_stock_build": "keras_optimizers",
    "stateless_value": "jax_trainer",
    "symbolic_build": "trainer",
    "unscale_loss_for_distribution": "trainer",
    "update_metrics_variables": "jax_trainer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'mpt_keras.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mpt_keras.compat.{_HOMES[name]}"), name)
    globals()[name] = value
    return value

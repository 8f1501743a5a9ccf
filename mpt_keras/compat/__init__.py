"""Every touch of a private Keras, TensorFlow or TFDS name, each tested for the versions we pin.

The package calls these (`from mpt_keras import compat`), never a private name itself;
`tests/test_compat*.py` fail naming the version when one moves, and `check()` lists the
names this Keras no longer has.

    optimizers.py     `maybe_merge_call`, `called_cond`, `gradients_already_reduced`
                      (after `install`), `skip_stock_build`, `learning_rate_schedule`
    trainer.py        `keras_trainer_class` (the compile hook); `compile_config`,
                      `call_has_training_arg`, `compute_loss`, `reduce_per_replica`,
                      `loss_tracker`, `unscale_loss_for_distribution` (the XLA step);
                      `symbolic_build`, `replace_maybe_symbolic_build`,
                      `restore_maybe_symbolic_build`, `in_multi_worker_mode`
    layers.py         `replace_dtype_policy`, `direct_sublayers`, `producing_layer`,
                      `producing_node`, `graph_calls`, `call_records_restored`
    data.py           `dataset_inputs`: the chain of a tf.data pipeline
    inventory.py      `check`: the touched names this Keras or TensorFlow lacks
    tf_distribute.py  TensorFlow's coordination service (multi-worker heartbeats)
    tfds_progress.py  TFDS's progress-bar switch
    determinism.py    `op_determinism`: TensorFlow's op determinism, on and back off
                      (these three are imported from their modules, not re-exported)
"""

from mpt_keras.compat.data import dataset_inputs
from mpt_keras.compat.inventory import check
from mpt_keras.compat.layers import (
    call_records_restored,
    direct_sublayers,
    graph_calls,
    producing_layer,
    producing_node,
    replace_dtype_policy,
)
from mpt_keras.compat.optimizers import (
    called_cond,
    gradients_already_reduced,
    install,
    learning_rate_schedule,
    maybe_merge_call,
    skip_stock_build,
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

__all__ = [
    "call_has_training_arg",
    "call_records_restored",
    "called_cond",
    "check",
    "compile_config",
    "compute_loss",
    "dataset_inputs",
    "direct_sublayers",
    "gradients_already_reduced",
    "graph_calls",
    "in_multi_worker_mode",
    "install",
    "keras_trainer_class",
    "learning_rate_schedule",
    "loss_tracker",
    "maybe_merge_call",
    "producing_layer",
    "producing_node",
    "reduce_per_replica",
    "replace_dtype_policy",
    "replace_maybe_symbolic_build",
    "restore_maybe_symbolic_build",
    "skip_stock_build",
    "symbolic_build",
    "unscale_loss_for_distribution",
]

"""tf.distribute strategies by name (`backend.names.STRATEGIES_ON["tensorflow"]`).

auto          a TPU if configured (`tpu` given, or attached), else `mirrored` over
              several local GPUs, else TensorFlow's default strategy
one_device    OneDeviceStrategy on the first GPU, else the CPU
mirrored      MirroredStrategy over local GPUs, or `virtual_cpus` logical CPUs
multi_worker  MultiWorkerMirroredStrategy over TF_CONFIG's workers
tpu           TPUStrategy on the TPU at `tpu`
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from mpt_keras.backend.names import check_strategy
from mpt_keras.backend.tensorflow import multi_worker
from mpt_keras.backend.tensorflow.tpu_connection import tpu_strategy
from mpt_keras.checks import check_number
from mpt_keras.errors import UserInputError


def make_strategy(
    name: str, virtual_cpus: int = 0, tpu: str | None = None
) -> tf.distribute.Strategy:
    """Creates strategy `name`; create the model and optimizer under its `scope()`.

    `virtual_cpus` (`mirrored` only; 0: off): call before any TF op, as the CPU splits only
    before TF initializes its runtime. `tpu` (for `tpu`, `auto`): a gRPC address
    (`grpc://10.0.0.2:8470`), a Cloud TPU name, or `local` on a TPU VM.

    Raises:
        UserInputError: An unknown name, an argument the strategy does not take, virtual CPUs
            too late, a missing or malformed TF_CONFIG, or no TPU found.
    """
    check_strategy(name, "tensorflow")
    check_number("virtual_cpus", virtual_cpus, minimum=0, integer=True)
    if virtual_cpus and name != "mirrored":
        raise UserInputError(
            f"virtual_cpus={virtual_cpus} needs strategy 'mirrored'; received strategy "
            f"'{name}'. Allowed: virtual_cpus=0, or strategy 'mirrored'"
        )
    if tpu is not None and name not in ("tpu", "auto"):
        raise UserInputError(
            f"tpu='{tpu}' needs strategy 'tpu' or 'auto'; received strategy '{name}'. "
            "Allowed: no tpu, or strategy 'tpu' or 'auto'"
        )
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        # No GPUs or virtual_cpus: the CPU devices split before.
        return _mirrored(_split_cpu(virtual_cpus) if virtual_cpus else None)
    if name == "multi_worker":
        multi_worker.check_tf_config()
        multi_worker.bound_peer_heartbeats()
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu" or tpu is not None:
        return tpu_strategy(tpu)
    # name == "auto"
    if tf.config.list_physical_devices("TPU"):
        return tpu_strategy("local")
    if len(tf.config.list_physical_devices("GPU")) > 1:
        return _mirrored()
    return tf.distribute.get_strategy()


# One MirroredStrategy per device set and process: each numbers its all-reduces from the same
# keys and TF remembers a key's shape for the process's life, so a second run with another
# model aborted ("Shape mismatch in the collective instance 101"). Keyed by the devices it
# runs on, however asked for: `virtual_cpus=2`, then none on the CPU already split, is one.
_MIRRORED: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _mirrored(devices: Sequence[str] | None = None) -> tf.distribute.MirroredStrategy:
    strategy = tf.distribute.MirroredStrategy(list(devices) if devices else None)
    return _MIRRORED.setdefault(tuple(strategy.extended.worker_devices), strategy)


def _split_cpu(virtual_cpus: int) -> list[str]:
    """Splits the CPU into `virtual_cpus` logical devices; returns the names."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * virtual_cpus
        )
    except RuntimeError:
        # Too late; fine if already split this way.
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing != virtual_cpus:
            raise UserInputError(
                f"virtual_cpus={virtual_cpus}: TensorFlow's runtime is already initialized "
                f"with {existing} CPU device(s), so the CPU can no longer be split; create the "
                "strategy before any other TensorFlow op. "
                f"Allowed now: virtual_cpus={existing}"
            ) from None
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def in_cross_replica_context() -> bool:
    """Whether code runs in a strategy's cross-replica context (where a merged update runs)."""
    return tf.distribute.in_cross_replica_context()


def current_strategy() -> tf.distribute.Strategy:
    """The strategy in scope (TensorFlow's default one when none is)."""
    return tf.distribute.get_strategy()


def on_one_device() -> bool:
    """Whether code runs with no strategy or a `OneDeviceStrategy`: any other, even with one
    replica, merges the update (`merge_call`), which XLA cannot hold."""
    return not tf.distribute.has_strategy() or isinstance(
        current_strategy(), tf.distribute.OneDeviceStrategy
    )

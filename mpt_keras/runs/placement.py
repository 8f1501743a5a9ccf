"""Where a run executes, on either Keras backend: the one place `training.py` asks.

On TensorFlow: a tf.distribute strategy, its chief, peer failures, per-worker write
directories, op determinism and tf.train checkpoints (`backend/tensorflow/`). On JAX: a Keras
distribution (`backend/jax/distribution.py`), process 0 as chief, NumPy checkpoints
(`reliability/array_checkpoints.py`); XLA on CPU is deterministic as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import keras

from mpt_keras.backend import current
from mpt_keras.config import DataConfig, TrainConfig
from mpt_keras.data.example_arrays import count
from mpt_keras.data.sources import RunData
from mpt_keras.errors import UserInputError


@dataclasses.dataclass(frozen=True)
class Placement:
    """`strategy`: the tf.distribute strategy; on JAX the Keras distribution (None: one device)."""

    strategy: Any
    chief: bool


def make_placement(config: TrainConfig) -> Placement:
    """The run's strategy; call first (CPUs split only before the backend's first operation).
    `UserInputError` for a strategy or argument this backend does not serve."""
    if current.is_jax():
        from mpt_keras.backend.jax import distribution

        if config.deterministic:
            distribution.deterministic_gpu_ops()
        made = distribution.make_distribution(config.strategy, config.virtual_cpus, config.tpu)
        return Placement(made, current.is_chief(None))
    from mpt_keras.backend.tensorflow import distribute, workers

    strategy = distribute.make_strategy(config.strategy, config.virtual_cpus, config.tpu)
    return Placement(strategy, workers.is_chief(strategy))


@contextlib.contextmanager
def scope(placement: Placement, model_dir: str) -> Iterator[None]:
    """Build and train inside: the strategy's scope; on TensorFlow a dead peer's abort becomes
    a `PeerFailedError` naming `model_dir`."""
    if current.is_jax():
        distribution = placement.strategy
        with distribution.scope() if distribution is not None else contextlib.nullcontext():
            yield
        return
    from mpt_keras.backend.tensorflow import multi_worker

    strategy = placement.strategy
    with multi_worker.peer_failures_as_errors(strategy, model_dir), strategy.scope():
        yield


def check_batches(placement: Placement, data: DataConfig, run_data: RunData) -> None:
    """Refuses, in one line and before anything is written, a batch a JAX `data_parallel` run
    cannot split evenly over its devices (train batches, and each evaluation batch)."""
    distribution = placement.strategy
    if not current.is_jax() or distribution is None:
        return
    devices = distribution.device_mesh.devices.size
    # On JAX the data are arrays (data/sources.py); x a dict of them for named inputs.
    eval_count = count(run_data.eval[0])
    # What each size is, and the hint where the size comes from the evaluation examples.
    evaluation = " (data.eval_examples sets the evaluation examples)"
    sizes = {"data.batch_size": (data.batch_size, "")}
    if eval_count >= data.eval_batch_size:
        sizes["data.eval_batch_size"] = (data.eval_batch_size, evaluation)
    if eval_count % data.eval_batch_size:
        sizes["the last evaluation batch"] = (eval_count % data.eval_batch_size, evaluation)
    for what, (size, hint) in sizes.items():
        if size % devices:
            raise UserInputError(
                f"{what}: received {size}, which data_parallel cannot split over its {devices} "
                f"devices. Allowed: a multiple of {devices}{hint}"
            )


@contextlib.contextmanager
def write_dir(placement: Placement, model_dir: str) -> Iterator[str]:
    """The directory this worker saves into: `model_dir`, but a TF non-chief's own."""
    if current.is_jax():
        yield model_dir
        return
    from mpt_keras.backend.tensorflow import workers

    with workers.worker_write_dir(model_dir, placement.strategy) as directory:
        yield directory


def determinism(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """TensorFlow's op determinism inside, when `enabled`; on JAX `make_placement` asked XLA
    for deterministic GPU kernels, and its CPU programs are deterministic as they are."""
    if current.is_jax():
        return contextlib.nullcontext()
    from mpt_keras.compat import determinism as tf_determinism

    return tf_determinism.op_determinism(enabled)


def checkpointer(
    model_dir: str,
    model: keras.Model,
    optimizer: keras.Optimizer,
    keep: int,
    write_dir: str,
    extra_variables: Mapping[str, keras.Variable],
) -> Any:
    """The run's checkpointer: tf.train checkpoints on TensorFlow, NumPy files on JAX (both
    `restore() -> step` and `save(step)`)."""
    if current.is_jax():
        from mpt_keras.reliability.array_checkpoints import ArrayCheckpointer

        return ArrayCheckpointer(model_dir, model, optimizer, keep, extra_variables)
    from mpt_keras.backend.tensorflow.checkpoints import Checkpointer

    return Checkpointer(
        model_dir, model, optimizer, keep=keep, write_dir=write_dir, extra_variables=extra_variables
    )

"""tf.distribute strategies by name, and which worker writes files.

    auto          a TPU if one is configured (`tpu` given, or TPU devices
                  attached), else `mirrored` over the local GPUs if there are
                  several, else TensorFlow's default strategy (one device, no
                  distribution machinery in the input pipeline)
    one_device    OneDeviceStrategy on the first GPU, else the CPU
    mirrored      MirroredStrategy over all local GPUs, or over `virtual_cpus`
                  logical CPU devices (to run it on any one machine)
    multi_worker  MultiWorkerMirroredStrategy over the workers named in the
                  TF_CONFIG environment variable
    tpu           TPUStrategy on the TPU at `tpu`

Under `multi_worker` every worker takes part in saving (saving reads variables
collectively) but only the chief's files count: `is_chief` says which worker
that is, and `worker_write_dir` gives each worker the directory to write into.
`support_multi_worker_fit` makes Keras 3's `fit` and `evaluate` run there at
all (`mpt_keras.execution.xla.compile_model` calls it).

A `multi_worker` run does not hang when a worker dies. The coordination service
that MultiWorkerMirroredStrategy runs on the chief (worker 0 if there is no
chief) takes a worker that sent it no heartbeat for `PEER_TIMEOUT_SECONDS` as
failed and aborts every other worker's collectives; a worker whose connection to
the dead one breaks aborts them at once. So a surviving worker stops within
about `PEER_TIMEOUT_SECONDS` plus the service's next health check, wherever it
was (measured on loopback after `kill -9`: 4-12 s, under 2 s when the chief
dies). `peer_failures_as_errors` turns that abort into one `PeerFailedError`
naming the peer; rerunning all workers on the same `model_dir` resumes from the
last checkpoint.

Example:

    strategy = make_strategy("mirrored", virtual_cpus=2)  # Before any other TF op.
    with strategy.scope():
        model = ...
    with worker_write_dir(model_dir, strategy) as write_dir:
        model.save(os.path.join(write_dir, "model.keras"))

Why one module: making a strategy, knowing the chief, writing per worker
and surviving a dead peer all read the same cluster description (TF_CONFIG,
the coordination service); split, each part would parse it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

from mpt_keras import compat
from mpt_keras.config import STRATEGIES
from mpt_keras.errors import PeerFailedError, UserInputError

# Resolving a TPU name asks the GCE metadata server and the Cloud TPU API, and
# connecting to a gRPC address that nothing answers blocks with no time limit
# (measured: more than 120 s); these bound both.
TPU_RESOLVE_TIMEOUT_SECONDS = 30.0
TPU_CONNECT_TIMEOUT_SECONDS = 10.0
# A `multi_worker` worker that sends no heartbeat for this long is taken as
# failed. TensorFlow's default (kDefaultHeartbeatTimeoutMs of its coordination
# service), pinned here: ParameterServerStrategy found 1 s to give spurious
# failures, and a busy worker on a loaded machine must not count as dead.
PEER_TIMEOUT_SECONDS = 10

# The errors a worker's collectives end with when a peer is gone: the
# coordination service's verdict and a broken connection come as UNAVAILABLE
# (both seen on loopback), collectives cut short alongside as CANCELLED or
# ABORTED, a collective timeout as DEADLINE_EXCEEDED. INTERNAL (which the
# strategy's Python health check also uses) counts only if it names
# collectives: it is TensorFlow's error for bugs too.
_PEER_FAILURE_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
)
_TASK_NAME = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
_ABORT_REASON = re.compile(r"aborted by: (.*)")

_MAX_REASON_CHARACTERS = 160
_TF_CONFIG_SHAPE = (
    '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'
)


def make_strategy(
    name: str, virtual_cpus: int = 0, tpu: str | None = None
) -> tf.distribute.Strategy:
    """Creates the strategy `name`.

    With `virtual_cpus`, call it before any other TensorFlow op: the CPU can be
    split only before TensorFlow initializes its runtime.

    Args:
        name: A strategy name, see the module docstring.
        virtual_cpus: Logical CPU devices to split the CPU into (`mirrored`
            only; 0: off).
        tpu: The TPU for `tpu` and `auto`: a gRPC address
            (`grpc://10.0.0.2:8470`), a Cloud TPU name, or `local` on a TPU VM.

    Returns:
        The strategy; create the model and optimizer under its `scope()`.

    Raises:
        UserInputError: For an unknown name, an argument the strategy does not
            take, virtual CPUs asked for too late, a missing or malformed
            TF_CONFIG (`multi_worker`), or no TPU found (`tpu`).

    Example:

        strategy = make_strategy("mirrored", virtual_cpus=2)
        strategy.num_replicas_in_sync  # 2
    """
    if name not in STRATEGIES:
        raise UserInputError(f"unknown strategy '{name}'. Allowed: {', '.join(STRATEGIES)}")
    if not isinstance(virtual_cpus, int) or virtual_cpus < 0:
        raise UserInputError(
            f"virtual_cpus must be an integer >= 0. Received: virtual_cpus={virtual_cpus!r}"
        )
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
        if virtual_cpus:
            return _mirrored(_split_cpu(virtual_cpus))
        # Without GPUs, MirroredStrategy takes the logical CPU devices: one
        # replica unless this process split the CPU before.
        return _mirrored()
    if name == "multi_worker":
        _check_tf_config()
        _bound_peer_heartbeats()
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu" or tpu is not None:
        return _tpu_strategy(tpu)
    # name == "auto"
    if tf.config.list_physical_devices("TPU"):
        return _tpu_strategy("local")
    if len(tf.config.list_physical_devices("GPU")) > 1:
        return _mirrored()
    return tf.distribute.get_strategy()


# One MirroredStrategy per device set and process. Each new MirroredStrategy
# numbers its collective all-reduces from the same keys, and TensorFlow's
# collective runtime remembers a key's shape for the life of the process: a
# second run with another model in the same process (a notebook, the canary,
# validation's baseline and candidate) aborted every collective with "Shape
# mismatch in the collective instance 101". Reused, the strategy numbers on.
_MIRRORED: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _mirrored(devices: Sequence[str] | None = None) -> tf.distribute.MirroredStrategy:
    key = tuple(devices or ())
    if key not in _MIRRORED:
        _MIRRORED[key] = tf.distribute.MirroredStrategy(list(devices) if devices else None)
    return _MIRRORED[key]


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this worker's checkpoints, summaries and model files count.

    Under MultiWorkerMirroredStrategy that is the `chief` task, or worker 0 if
    TF_CONFIG names no chief (TensorFlow's multi-worker Keras tutorial); under
    any other strategy, the one process.

    Example:

        if is_chief(strategy):
            write_json(os.path.join(model_dir, "metrics.json"), metrics)
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    resolver = strategy.cluster_resolver
    return _is_chief_task(resolver.task_type, resolver.task_id, resolver.cluster_spec().jobs)


@contextlib.contextmanager
def worker_write_dir(model_dir: str, strategy: tf.distribute.Strategy) -> Iterator[str]:
    """The directory this worker saves into: `model_dir` on the chief.

    Every worker must run the same saves (`model.save`, a CheckpointManager's
    `save`), because saving reads variables collectively; a non-chief worker
    saves into a temporary directory of its own, removed when the block exits,
    as in TensorFlow's multi-worker Keras and CheckpointManager guides. Restore
    from `model_dir` on every worker.

    Args:
        model_dir: The run's output directory.
        strategy: The run's strategy.

    Yields:
        `model_dir` on the chief, else a fresh temporary directory.

    Example:

        with worker_write_dir(model_dir, strategy) as write_dir:
            model.save(os.path.join(write_dir, "model.keras"))
    """
    if is_chief(strategy):
        yield model_dir
        return
    temporary = tempfile.mkdtemp(prefix="mpt_worker_")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


@contextlib.contextmanager
def peer_failures_as_errors(strategy: tf.distribute.Strategy, model_dir: str) -> Iterator[None]:
    """Turns the abort of a multi-worker run by a dead peer into a `PeerFailedError`.

    Wrap everything that runs collectives (restoring, `fit`, `evaluate`,
    saving). Under any other strategy, or for any other error, it does nothing.

    Args:
        strategy: The run's strategy.
        model_dir: The run's output directory, named in the message as the one
            a rerun resumes from.

    Raises:
        PeerFailedError: A peer worker stopped answering and TensorFlow aborted
            this worker's collectives (see the module docstring).

    Example:

        with peer_failures_as_errors(strategy, model_dir):
            model.fit(dataset, epochs=2, steps_per_epoch=100)
    """
    try:
        yield
    except (*_PEER_FAILURE_ERRORS, tf.errors.InternalError) as error:
        if not (_in_multi_worker_mode(strategy) and _is_peer_failure(error)):
            raise
        resolver = strategy.cluster_resolver
        this_worker = (resolver.task_type, resolver.task_id)
        peers = sorted(
            {(job, int(task)) for job, task in _TASK_NAME.findall(error.message)} - {this_worker}
        )
        named = ", ".join(f"{job} {task}" for job, task in peers) or "a peer worker"
        aborted_by = _ABORT_REASON.search(error.message)
        reason = _first_sentence(aborted_by.group(1) if aborted_by else error.message)
        cluster_spec = resolver.cluster_spec()
        workers = sum(
            cluster_spec.num_tasks(job) for job in cluster_spec.jobs if job in ("chief", "worker")
        )
        raise PeerFailedError(
            f"{this_worker[0]} {this_worker[1]}: {named} stopped answering, so TensorFlow "
            f"aborted this worker's collectives ({type(error).__name__}: {reason.rstrip(' :')}). "
            f"The checkpoints saved so far are complete: rerun all {workers} workers with the "
            f"same model_dir {model_dir} to resume from the last one"
        ) from None


def support_multi_worker_fit(model: keras.Model) -> None:
    """Lets Keras' `fit` and `evaluate` run under a multi-worker strategy.

    Keras 3.15 fails there (keras-team/keras#20585) in two places: it reduces a
    whole (x, y) batch with `strategy.reduce` to build the model, and it
    reduces each scalar step output with `strategy.reduce(..., axis=0)`. This
    builds from the first replica's batch instead (only shapes and dtypes are
    used) and gives the train and test steps' scalar outputs a length-1 axis,
    which that reduction then averages over the replicas to a scalar again, as
    Keras does on one worker. It wraps the model's current steps: call it
    after compiling. Under any other strategy it does nothing.

    Example:

        with strategy.scope():
            model.compile(optimizer=..., loss=...)
        support_multi_worker_fit(model)
        model.fit(dataset, epochs=2, steps_per_epoch=100)
    """
    strategy = model.distribute_strategy
    if not _in_multi_worker_mode(strategy):
        return

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
    model.train_step = with_replica_axis(model.train_step)
    model.test_step = with_replica_axis(model.test_step)


def _in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    multi_worker_strategy = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    return multi_worker_strategy and compat.in_multi_worker_mode(strategy)


def _is_peer_failure(error: tf.errors.OpError) -> bool:
    if isinstance(error, _PEER_FAILURE_ERRORS):
        return True
    return "collective" in error.message.lower()


def _bound_peer_heartbeats() -> None:
    """Configures the coordination service with `PEER_TIMEOUT_SECONDS`.

    MultiWorkerMirroredStrategy configures the service only if nothing has yet,
    and then with TensorFlow's default heartbeat timeout
    (`CollectiveAllReduceExtended._initialize_multi_worker` in TensorFlow's
    collective_all_reduce_strategy.py); this configures it first, as the
    strategy would, with the timeout pinned, as ParameterServerStrategyV2's
    `_configure_coordination_service` does with its own. The service replaces
    the strategy's Python health check, which it then turns off.
    """
    if context.context().coordination_service is not None:
        return
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster_spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    coordinated = [job for job in ("chief", "worker") if job in cluster_spec.jobs]
    if resolver.task_type not in coordinated:
        return  # The strategy configures no service for other tasks either.
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=PEER_TIMEOUT_SECONDS * 1000,
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in coordinated
        ],
    )


def _is_chief_task(task_type: str | None, task_id: int | None, jobs: list[str]) -> bool:
    if task_type is None:  # One worker and no TF_CONFIG: MWMS on local devices.
        return True
    if "chief" in jobs:
        return task_type == "chief"
    return task_type == "worker" and task_id == 0


def _split_cpu(virtual_cpus: int) -> list[str]:
    """Splits the CPU into `virtual_cpus` logical devices; returns their names."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * virtual_cpus
        )
    except RuntimeError:
        # Too late to split; fine if the CPU already is split this way.
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing != virtual_cpus:
            raise UserInputError(
                f"virtual_cpus={virtual_cpus}: TensorFlow's runtime is already initialized "
                f"with {existing} CPU device(s), so the CPU can no longer be split; create the "
                "strategy before any other TensorFlow op. "
                f"Allowed now: virtual_cpus={existing}"
            ) from None
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def _check_tf_config() -> None:
    """Checks TF_CONFIG names a cluster of workers and this task in it."""
    text = os.environ.get("TF_CONFIG")
    problem = None
    if not text:
        problem = "is not set"
    else:
        try:
            tf_config = json.loads(text)
        except json.JSONDecodeError as error:
            tf_config = None
            problem = f"is not JSON ({error.msg} at character {error.pos})"
        if tf_config is not None:
            problem = _tf_config_problem(tf_config)
    if problem:
        raise UserInputError(
            f"strategy 'multi_worker': TF_CONFIG {problem}. Allowed: JSON like {_TF_CONFIG_SHAPE}"
        )


def _tf_config_problem(tf_config: Any) -> str | None:
    cluster = tf_config.get("cluster") if isinstance(tf_config, dict) else None
    if not isinstance(cluster, dict) or not any(
        isinstance(cluster.get(job), list) and cluster[job] for job in ("chief", "worker")
    ):
        return "has no 'cluster' with a non-empty 'worker' or 'chief' list"
    task = tf_config.get("task")
    if not isinstance(task, dict):
        return "has no 'task' object"
    task_type, index = task.get("type"), task.get("index")
    addresses = cluster.get(task_type)
    if (
        not isinstance(addresses, list)
        or not isinstance(index, int)
        or not 0 <= index < len(addresses)
    ):
        return f"task {json.dumps(task)} is not in its cluster"
    return None


def _tpu_strategy(address: str | None) -> tf.distribute.TPUStrategy:
    """Connects to the TPU at `address` (None: from TPU_NAME) and makes its strategy."""
    where = f"at '{address}'" if address else "without an address"

    def not_found(reason: Any) -> UserInputError:
        return UserInputError(
            f"strategy 'tpu': no TPU found {where} ({_first_sentence(reason)}). "
            "Allowed: a TPU address via --tpu, or another --strategy"
        )

    outcome: dict[str, Any] = {}

    def resolve() -> None:
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            outcome["resolved"] = resolver, resolver.master()
        except Exception as error:  # Reported from the calling thread.
            outcome["error"] = f"{type(error).__name__}: {error}"

    # In a daemon thread: the lookups have no timeout of their own, and a
    # thread still waiting does not keep the process alive.
    thread = threading.Thread(target=resolve, name="mpt-resolve-tpu", daemon=True)
    thread.start()
    thread.join(TPU_RESOLVE_TIMEOUT_SECONDS)
    if thread.is_alive():
        raise not_found(f"no answer within {TPU_RESOLVE_TIMEOUT_SECONDS:g} s")
    if "error" in outcome:
        raise not_found(outcome["error"])
    resolver, master = outcome["resolved"]
    if master.startswith("grpc://"):
        endpoint = urllib.parse.urlsplit(master)
        try:
            socket.create_connection(
                (endpoint.hostname, endpoint.port), timeout=TPU_CONNECT_TIMEOUT_SECONDS
            ).close()
        except OSError as error:
            raise not_found(f"cannot connect to {master}: {error}") from None
    try:
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (tf.errors.OpError, ValueError, RuntimeError) as error:
        raise not_found(getattr(error, "message", error)) from None
    return tf.distribute.TPUStrategy(resolver)


def _first_sentence(reason: Any) -> str:
    # TensorFlow's errors run on with node and kernel details; the first
    # sentence says what failed.
    text = " ".join(str(reason).split())
    return re.split(r"(?<=\.) ", text, maxsplit=1)[0][:_MAX_REASON_CHARACTERS] or "no details"

"""A `multi_worker` cluster: TF_CONFIG checked, a dead peer reported, not waited on.

The coordination service aborts all collectives once a peer sends no heartbeat for
`PEER_TIMEOUT_SECONDS` or its connection breaks (loopback, `kill -9`: survivors stop in 4-12 s,
under 2 s when the chief dies).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from mpt_keras import compat
from mpt_keras.backend.tensorflow.tf_errors import first_sentence
from mpt_keras.compat import tf_distribute
from mpt_keras.errors import PeerFailedError, UserInputError

# TF's default, pinned: a busy worker on a loaded machine must not count as dead.
PEER_TIMEOUT_SECONDS = 10

# How collectives end when a peer is gone; INTERNAL only naming collectives (TF's bug error too).
_PEER_FAILURE_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.CancelledError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
)
_TASK_NAME = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")
_ABORT_REASON = re.compile(r"aborted by: (.*)")
_TF_CONFIG_SHAPE = (
    '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'
)


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` is MultiWorkerMirroredStrategy over several workers."""
    multi_worker_strategy = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    return multi_worker_strategy and compat.in_multi_worker_mode(strategy)


def check_tf_config() -> None:
    """UserInputError unless TF_CONFIG names a worker cluster and this task in it."""
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


def bound_peer_heartbeats() -> None:
    """Configures the coordination service with `PEER_TIMEOUT_SECONDS`; call before the strategy
    (which configures it, with its default, only if nothing has)."""
    if tf_distribute.coordination_service_configured():
        return
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster_spec = resolver.cluster_spec()
    coordinated = [job for job in ("chief", "worker") if job in cluster_spec.jobs]
    if resolver.task_type not in coordinated:
        return  # The strategy configures no service for other tasks either.
    tf_distribute.configure_coordination_service(
        leader=tf_distribute.coordination_leader(cluster_spec),
        heartbeat_timeout_ms=PEER_TIMEOUT_SECONDS * 1000,
        jobs={job: cluster_spec.num_tasks(job) for job in coordinated},
    )


@contextlib.contextmanager
def peer_failures_as_errors(strategy: tf.distribute.Strategy, model_dir: str) -> Iterator[None]:
    """Around all that runs collectives: a dead peer's abort becomes a `PeerFailedError`,
    naming the peer, TF's reason and `model_dir` (where a rerun resumes)."""
    try:
        yield
    except (*_PEER_FAILURE_ERRORS, tf.errors.InternalError) as error:
        if not (in_multi_worker_mode(strategy) and _is_peer_failure(error)):
            raise
        resolver = strategy.cluster_resolver
        this_worker = (resolver.task_type, resolver.task_id)
        peers = sorted(
            {(job, int(task)) for job, task in _TASK_NAME.findall(error.message)} - {this_worker}
        )
        named = ", ".join(f"{job} {task}" for job, task in peers) or "a peer worker"
        aborted_by = _ABORT_REASON.search(error.message)
        reason = first_sentence(aborted_by.group(1) if aborted_by else error.message)
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


def _is_peer_failure(error: tf.errors.OpError) -> bool:
    if isinstance(error, _PEER_FAILURE_ERRORS):
        return True
    return "collective" in error.message.lower()

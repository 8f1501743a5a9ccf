"""TensorFlow's private coordination-service calls, which `multi_worker` needs to bound heartbeats.

TensorFlow has no public way to configure the service before MultiWorkerMirroredStrategy does.
"""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context


def coordination_service_configured() -> bool:
    """Whether `tensorflow.python.eager.context.context().coordination_service` is set (TF 2.21)."""
    return context.context().coordination_service is not None


def coordination_leader(cluster_spec: tf.train.ClusterSpec) -> str:
    """`tensorflow.python.distribute.multi_worker_util.coordination_leader` (TF 2.21)."""
    return multi_worker_util.coordination_leader(cluster_spec)


def configure_coordination_service(
    leader: str, heartbeat_timeout_ms: int, jobs: Mapping[str, int]
) -> None:
    """`tensorflow.python.eager.context.context().configure_coordination_service` (TF 2.21).

    A standalone service led by `leader`; `jobs`: each coordinated job's task count.
    """
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=leader,
        heartbeat_timeout_in_ms=heartbeat_timeout_ms,
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=tasks)
            for job, tasks in jobs.items()
        ],
    )

"""Tests of mpt_keras.compat.tf_distribute: TensorFlow's private coordination-service calls.

Configuring the service changes the process's TensorFlow context, so that test
runs in a child process (`replicas.run_child`). Each fails naming the
TensorFlow version.
"""

from typing import Any

import pytest
import tensorflow as tf
from replicas import run_child

from mpt_keras.compat import tf_distribute

VERSION = f"TensorFlow {tf.__version__}"


@pytest.mark.parametrize(
    ("cluster", "leader"),
    [
        ({"worker": ["a:1", "b:1"]}, "/job:worker/replica:0/task:0"),
        ({"chief": ["c:1"], "worker": ["a:1"]}, "/job:chief/replica:0/task:0"),
    ],
    ids=["worker_0", "chief"],
)
def test_coordination_leader_is_the_chief_else_worker_0(cluster, leader):
    got = tf_distribute.coordination_leader(tf.train.ClusterSpec(cluster))
    assert got == leader, f"{VERSION}: multi_worker_util.coordination_leader changed"


def test_configuring_the_service_sets_what_the_strategy_would_find():
    assert run_child("test_compat_tf_distribute", "_configured", virtual_cpus=0, timeout=300) == {
        "before": False,
        "after": True,
        "service_type": "standalone",
        "service_leader": "/job:worker/replica:0/task:0",
        "heartbeat_timeout_in_ms": 10_000,
        "jobs": [["chief", 1], ["worker", 2]],
    }, f"{VERSION}: context.configure_coordination_service or coordination_service changed"


def _configured() -> dict[str, Any]:
    """In a fresh process: the service's configuration before and after configuring it."""
    from tensorflow.python.eager import context

    before = tf_distribute.coordination_service_configured()
    tf_distribute.configure_coordination_service(
        leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_ms=10_000,
        jobs={"chief": 1, "worker": 2},
    )
    config = context.context().coordination_service
    return {
        "before": before,
        "after": tf_distribute.coordination_service_configured(),
        "service_type": config.service_type,
        "service_leader": config.service_leader,
        "heartbeat_timeout_in_ms": config.heartbeat_timeout_in_ms,
        "jobs": [[job.name, job.num_tasks] for job in config.coordinated_job_list],
    }

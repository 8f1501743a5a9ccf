"""Which worker writes files: the chief's count, the others write aside; all run the same
saves (saving reads variables collectively).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import tensorflow as tf


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this worker's checkpoints, summaries and model files count: under
    MultiWorkerMirroredStrategy the `chief` task, or worker 0 without one; else the process.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    resolver = strategy.cluster_resolver
    return _is_chief_task(resolver.task_type, resolver.task_id, resolver.cluster_spec().jobs)


@contextlib.contextmanager
def worker_write_dir(model_dir: str, strategy: tf.distribute.Strategy) -> Iterator[str]:
    """Yields the directory this worker saves into: `model_dir` on the chief.

    A non-chief gets its own temporary directory, removed on exit. All restore from `model_dir`.
    """
    if is_chief(strategy):
        yield model_dir
        return
    temporary = tempfile.mkdtemp(prefix="mpt_worker_")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _is_chief_task(task_type: str | None, task_id: int | None, jobs: list[str]) -> bool:
    if task_type is None:  # One worker and no TF_CONFIG: MWMS on local devices.
        return True
    if "chief" in jobs:
        return task_type == "chief"
    return task_type == "worker" and task_id == 0

"""TensorFlow's op determinism turned on for a run and back off after it (TensorFlow 2.21).

TensorFlow exports `enable_op_determinism` and no inverse; the private module has both, so a
process that trains again (a test, a notebook) gets the setting back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf
from tensorflow.python.framework import config as tf_config


@contextlib.contextmanager
def op_determinism(enabled: bool) -> Iterator[None]:
    """Op determinism on inside the block when `enabled`; as it was after it."""
    before = tf_config.is_op_determinism_enabled()
    if enabled and not before:
        tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        if enabled and not before:
            tf_config.disable_op_determinism()

"""The data check's touch of tf.data: the chain of datasets a pipeline transforms."""

from __future__ import annotations

from typing import Any


def dataset_inputs(dataset: Any) -> list[Any]:
    """The datasets a `tf.data.Dataset` transforms (none for a source; TensorFlow 2.21)."""
    return list(dataset._inputs())

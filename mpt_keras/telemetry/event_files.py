"""The monitor's TensorBoard event files on Keras' JAX backend, written by the `tensorboard`
package's own writer (no TensorFlow): the plugin metadata and tensor summaries that
`tf.summary` writes on TensorFlow (`backend/tensorflow/summaries.py`), read alike by
TensorBoard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

_SCALAR = scalar_metadata.create_summary_metadata(display_name="", description="")
_TEXT = text_metadata.create_summary_metadata(display_name="", description="")


class EventFiles:
    """An event file per `log_dir` subdirectory (`""`, `train`, `validation`); the interface
    of `summaries.SummaryWriters`, written eagerly on the host."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._writers: dict[str, EventFileWriter] = {}

    def write_scalars(
        self,
        name: str,
        step: int,
        scalars: dict[str, Any],
        extend: Callable[[dict[str, Any], Any], Any] | None = None,
        interval: tuple[int, int] | None = None,
    ) -> float | None:
        """As `SummaryWriters.write_scalars`: `scalars` and what `extend` adds; returns what
        `extend` returns, as a float (None without it)."""
        values = dict(scalars)
        result = extend(values, tuple(map(float, interval or (0, 0)))) if extend else None
        self._write(name, step, [_scalar(tag, float(value)) for tag, value in values.items()])
        return None if result is None else float(result)

    def scalar(self, name: str, step: int, tag: str, value: Any) -> None:
        self._write(name, step, [_scalar(tag, float(value))])

    def text(self, name: str, step: int, tag: str, text: str) -> None:
        tensor = tensor_util.make_tensor_proto(np.array(text, dtype=object))
        self._write(name, step, [summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=_TEXT)])

    def histogram(self, name: str, step: int, tag: str, values: np.ndarray) -> None:
        self._write(name, step, list(histogram_summary.histogram_pb(tag, values).value))

    def serialized(self, name: str, step: int, tag: str, data: bytes, metadata: Any) -> None:
        """Writes `data` as a string tensor with a plugin's `metadata` (a SummaryMetadata)."""
        tensor = tensor_util.make_tensor_proto(np.array(data, dtype=object))
        self._write(
            name, step, [summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)]
        )

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def _write(self, name: str, step: int, values: list[summary_pb2.Summary.Value]) -> None:
        if name not in self._writers:
            self._writers[name] = EventFileWriter(os.path.join(self.log_dir, name))
        event = event_pb2.Event(
            wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
        )
        self._writers[name].add_event(event)


def _scalar(tag: str, value: float) -> summary_pb2.Summary.Value:
    tensor = tensor_util.make_tensor_proto(np.float32(value))
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=_SCALAR)

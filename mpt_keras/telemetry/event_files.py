"""The monitor's TensorBoard event files on Keras' JAX backend, written by the `tensorboard`
package's own writer (no TensorFlow): the tags, plugin metadata and tensor summaries that
`tf.summary` writes on TensorFlow (summaries.py), read alike by TensorBoard.
"""

from __future__ import annotations

import os
import time
from typing import Any

import keras
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.custom_scalar import metadata as layout_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from mpt_keras.telemetry import layout as tags
from mpt_keras.telemetry.optimizer_scalars import optimizer_scalars, overflow_rate

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
        optimizer: keras.optimizers.Optimizer | None = None,
        interval: tuple[int, int] | None = None,
    ) -> float | None:
        """As `SummaryWriters.write_scalars`: `scalars`, the optimizer's scalars the logs lack
        and the overflow rate; returns the skipped steps (None without loss scaling)."""
        values = {tag: float(value) for tag, value in scalars.items()}
        skipped = None
        if optimizer is not None:
            values.update(
                (tag, float(value)) for tag, value in optimizer_scalars(optimizer, scalars).items()
            )
            skipped = values.get(tags.SKIPPED_STEPS)
            if skipped is not None and interval is not None:
                values[tags.OVERFLOW_RATE] = overflow_rate(skipped, *map(float, interval))
        self._write(name, step, [_scalar(tag, value) for tag, value in values.items()])
        return skipped

    def scalar(self, name: str, step: int, tag: str, value: Any) -> None:
        self._write(name, step, [_scalar(tag, float(value))])

    def text(self, name: str, step: int, tag: str, text: str) -> None:
        tensor = tensor_util.make_tensor_proto(np.array(text, dtype=object))
        self._write(name, step, [summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=_TEXT)])

    def write_layout(self, histograms: bool, float8: bool) -> None:
        """The dashboard (custom scalars), as `layout.write_layout` writes it with TensorFlow."""
        layout = tags.layout(histograms, float8).SerializeToString()
        value = summary_pb2.Summary.Value(
            tag=layout_metadata.CONFIG_SUMMARY_TAG,
            tensor=tensor_util.make_tensor_proto(np.array(layout, dtype=object)),
            metadata=layout_metadata.create_summary_metadata(),
        )
        self._write("", 0, [value])

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

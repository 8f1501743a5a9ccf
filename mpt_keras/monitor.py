"""TensorBoard summaries of a training run.

`MixedPrecisionMonitor` writes, keyed by the global train step:

    train/loss, train/<metric>   running mean over the current Keras epoch,
                                 every `update_freq` steps
    train/learning_rate          the inner optimizer's current learning rate
    train/loss_scale             the loss scale (a `LossScaleOptimizer`'s)
    train/skipped_steps          steps skipped so far for non-finite gradients
    validation/loss, ...         at each validation

under `log_dir/train` and `log_dir/validation`, the layout of Keras'
TensorBoard callback, so train and validation curves share a chart.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from mpt_keras.callbacks import GlobalStepCallback
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer


class MixedPrecisionMonitor(GlobalStepCallback):
    """A Keras callback writing training telemetry for TensorBoard.

    It reads model state only every `update_freq` steps, so it adds no
    host-device synchronisation to the other steps.

    Args:
        log_dir: Directory of the TensorBoard event files.
        update_freq: Steps between train summaries.

    Example:

        model.fit(x, y, callbacks=[MixedPrecisionMonitor("/tmp/run/logs")])
        # then: tensorboard --logdir /tmp/run/logs
    """

    def __init__(self, log_dir: str, update_freq: int = 10):
        super().__init__()
        if update_freq < 1:
            raise ValueError(f"update_freq must be >= 1. Received: update_freq={update_freq}")
        self.log_dir = log_dir
        self.update_freq = update_freq
        self._writers: dict[str, tf.summary.SummaryWriter] = {}

    def _writer(self, name: str) -> tf.summary.SummaryWriter:
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.log_dir, name))
        return self._writers[name]

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.global_step % self.update_freq == 0:
            optimizer = self.model.optimizer
            scalars = dict(logs or {})
            scalars["learning_rate"] = optimizer.learning_rate
            if isinstance(optimizer, LossScaleOptimizer):
                scalars["loss_scale"] = optimizer.loss_scale
                scalars["skipped_steps"] = optimizer.skipped_steps
            self._write("train", scalars)

    def on_epoch_end(self, epoch, logs=None):
        validation = {
            name.removeprefix("val_"): value
            for name, value in (logs or {}).items()
            if name.startswith("val_")
        }
        if validation:
            self._write("validation", validation)

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.flush()

    def _write(self, writer_name: str, scalars: dict) -> None:
        with self._writer(writer_name).as_default(step=self.global_step):
            for name, value in scalars.items():
                tf.summary.scalar(name, float(keras.ops.convert_to_numpy(value)))

"""`model_dir/metrics.csv`: a run's train figures as a table, one row per interval.

`MetricsCsv` writes a row every `every` steps (`mpt-train`: `log_every`) from
the step's Keras logs: `step`, the loss and metrics (running means over the
current epoch, as Keras logs them), and with `mpt_keras.LossScaleOptimizer`
`loss_scale`, `skipped_steps`, `bad_batches` and `gradient_norm`; the
validation figures (`val_loss`, ...) join the row of the step they were taken
at. A column that appears later (validation) widens the whole file; a value
a row does not have is left empty.

A resumed run keeps the rows up to the step it resumes from and drops the
later ones (the steps after the last checkpoint, which it trains again), so
no step has two rows. The file is rewritten whole, atomically, at each row:
a killed run leaves the last complete table.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from mpt_keras.backend.tensorflow import distribute
from mpt_keras.files import write_text_atomic
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback

STEP = "step"


class MetricsCsv(GlobalStepCallback):
    """A Keras callback writing the run's figures to a CSV file (see the module docstring).

    Only the chief writes under a multi-worker strategy.

    Args:
        path: The CSV file; existing rows up to the step training starts
            from are kept.
        every: Steps between rows.
    """

    def __init__(self, path: str, every: int):
        super().__init__()
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1. Received: every={every!r}")
        self.path = path
        self.every = every
        self._rows: list[dict[str, Any]] = []
        self._writes = True

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._writes = distribute.is_chief(self.model.distribute_strategy)
        self._rows = [row for row in _read(self.path) if int(row[STEP]) <= self.global_step]

    def on_train_batch_end(self, batch, logs=None):
        previous = self.global_step
        super().on_train_batch_end(batch, logs)
        if self.global_step // self.every > previous // self.every:
            self._add({STEP: self.global_step, **_numbers(logs)})

    def on_epoch_end(self, epoch, logs=None):
        validation = {k: v for k, v in _numbers(logs).items() if k.startswith("val_")}
        if validation:
            self._add({STEP: self.global_step, **validation})

    def _add(self, values: dict[str, Any]) -> None:
        if self._rows and int(self._rows[-1][STEP]) == values[STEP]:
            self._rows[-1].update(values)
        else:
            self._rows.append(values)
        if self._writes:
            write_text_atomic(self.path, _table(self._rows))


def _numbers(logs: dict[str, Any] | None) -> dict[str, float]:
    return {name: float(value) for name, value in (logs or {}).items()}


def _read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as file:
        return [
            {name: value for name, value in row.items() if value != ""}
            for row in csv.DictReader(file)
        ]


def _table(rows: list[dict[str, Any]]) -> str:
    columns = [STEP]
    for row in rows:
        columns.extend(name for name in row if name not in columns)
    columns = [STEP, *sorted(columns[1:])]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, restval="", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return out.getvalue()

"""`model_dir/metrics.csv`: a row every `every` steps: `step` and the step's Keras logs (epoch
running means; with `LossScaleOptimizer` its `step_logs`); validation joins its step's row.
A later column widens the file; a missing value is empty. A resumed run drops rows after its
step. Rewritten atomically per row: a killed run leaves the last complete table.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from mpt_keras.backend import current
from mpt_keras.checks import check_number
from mpt_keras.files import write_text_atomic
from mpt_keras.keras_bridge.callbacks import WorkerHookCallback

STEP = "step"


class MetricsCsv(WorkerHookCallback):
    """A Keras callback writing the run's figures to `path` (chief only), a row per `every`.

    Rows up to the step training starts from are kept. Its batch hook may run on Keras'
    worker thread, behind the steps; a row is added on `fit`'s thread, with its step's logs
    (`WorkerHookCallback`). `UserInputError`: `every` not an integer >= 1.
    """

    read_at_end = False  # Rows at every `every` steps only.

    def __init__(self, path: str, every: int):
        super().__init__()
        check_number("every", every, minimum=1, integer=True)
        self.path = path
        self.every = self.read_every = every
        self._rows: list[dict[str, Any]] = []
        self._writes = True
        self._last_logs: dict[str, Any] = {}

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._writes = current.is_chief(self.model)
        self._rows = [row for row in _read(self.path) if int(row[STEP]) <= self.global_step]

    def after_batch(self, previous_step, logs):
        self._last_logs = logs

    def read_model(self, previous_read_step):
        del previous_read_step  # A row is the step's.
        self._add({STEP: self.global_step, **_numbers(self._last_logs)})

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
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

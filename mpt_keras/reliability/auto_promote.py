"""AutoPromote: layers that keep overflowing move to a wider precision.

Loss scaling cannot fix a layer overflowing float16 at any scale: the scale sits at its floor,
every step skipped. At each check at the floor, a layer's streak grows by its variables' new
non-finite steps (the most of any one); a check without any, or above the floor, ends it. A
streak of `k` promotes it float16 -> bfloat16 -> float32 mid-`fit`. A forward overflow spoils
every gradient, so all layers are then promoted together (`calibration` finds the one).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mpt_keras.checks import check_number
from mpt_keras.files import write_text_atomic
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.promote import Promotion, promote
from mpt_keras.reliability.guards import loss_scale_optimizer
from mpt_keras.telemetry.monitor import summary_files

_LOGGER = logging.getLogger(__name__)


class AutoPromote(GlobalStepCallback):
    """Promotes layers whose gradients stay non-finite with the loss scale at its floor.

    Each promotion is logged, and written to `manifest_path` (the updated manifest) and
    `log_dir` (TensorBoard text) if given; `promotions` lists `(step, path, old, new)`.
    `manifest`: the model's (promotions go before its rules). `k`: see the module. `inputs`:
    example inputs, for a subclassed model of several heads (`PrecisionManifest.apply`).

    Its batch hook runs in step (it reads the optimizer and may retrace the step), so Keras
    runs every batch hook in step.

    Raises:
        UserInputError: `k` or `check_every` not an integer >= 1; at `fit`, an optimizer
            not a `mpt_keras.LossScaleOptimizer`.
    """

    async_safe = False

    def __init__(
        self,
        manifest: PrecisionManifest,
        k: int = 3,
        check_every: int = 10,
        manifest_path: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        inputs: Any = None,
    ):
        super().__init__()
        for name, value in (("k", k), ("check_every", check_every)):
            check_number(f"AutoPromote {name}", value, minimum=1, integer=True)
        self.manifest = manifest
        self.k = k
        self.check_every = check_every
        self.manifest_path = manifest_path
        self.log_dir = log_dir
        self.inputs = inputs
        self.promotions: list[tuple[int, str, str, str]] = []
        self._last_counts: dict[str, int] = {}
        self._last_check = 0
        self._streaks: dict[str, int] = {}
        self._owners: dict[str, str] = {}
        self._writer = None
        self._at_float32: set[str] = set()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        optimizer = loss_scale_optimizer(self.model, "AutoPromote")
        for path, layer in iter_layers(self.model):
            # Depth first, so a nested layer overrides the block holding it.
            for variable in layer.trainable_weights:
                self._owners[variable.path] = path
        self._last_counts = optimizer.nonfinite_counts()
        self._last_check = self.global_step
        if self.log_dir is not None and self._writer is None:
            self._writer = summary_files(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        # Not a modulo: the step jumps with steps_per_execution > 1.
        if self.global_step >= self._last_check + self.check_every:
            self._last_check = self.global_step
            self._check()

    def _check(self) -> None:
        optimizer = self.model.optimizer
        counts = optimizer.nonfinite_counts()
        at_floor = optimizer.loss_scale <= optimizer.min_scale
        new_steps: dict[str, int] = {}
        for variable_path, count in counts.items():
            layer_path = self._owners.get(variable_path)
            added = count - self._last_counts.get(variable_path, 0)
            if layer_path is not None and added > 0:
                new_steps[layer_path] = max(new_steps.get(layer_path, 0), added)
        self._last_counts = counts
        if not at_floor:
            self._streaks = {}
            return
        self._streaks = {
            path: self._streaks.get(path, 0) + added for path, added in new_steps.items()
        }
        due = [path for path, streak in self._streaks.items() if streak >= self.k]
        if due:
            self._promote(due)

    def _promote(self, paths: list[str]) -> None:
        self.manifest, promotions = promote(
            self.model,
            self.manifest,
            lambda promotion: f"AutoPromote {self._message(promotion)}",
            paths,
            self.inputs,
        )
        for promotion in promotions:
            message = self._message(promotion)
            self.promotions.append((self.global_step, promotion.path, promotion.old, promotion.new))
            self._streaks[promotion.path] = 0
            _LOGGER.warning("AutoPromote %s", message)
            if self._writer is not None:
                self._writer.text("auto_promote", self.global_step, "auto_promote", message)
                self._writer.flush()
        promoted = {promotion.path for promotion in promotions}
        for path in paths:
            if path not in promoted and path not in self._at_float32:
                self._at_float32.add(path)
                _LOGGER.warning(
                    "AutoPromote: layer %s keeps overflowing in float32; nothing wider to go to",
                    path,
                )
        if promotions and self.manifest_path is not None:
            write_text_atomic(self.manifest_path, self.manifest.to_json())

    def _message(self, promotion: Promotion) -> str:
        return (
            f"step {self.global_step}: layer {promotion.path} {promotion.old} -> {promotion.new}: "
            f"non-finite gradients on {self._streaks[promotion.path]} steps at loss scale "
            f"{self.model.optimizer.loss_scale:g} (the floor)"
        )

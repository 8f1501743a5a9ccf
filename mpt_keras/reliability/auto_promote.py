"""AutoPromote: a callback that moves layers that keep overflowing to a wider precision.

Dynamic loss scaling fixes gradients that overflow because the scale is too
high; it cannot fix a layer whose values overflow float16 at any scale: the
scale falls to its floor (`min_scale`) and every step is skipped. `AutoPromote`
watches for that and promotes the layers involved, float16 -> bfloat16 ->
float32, mid-`fit`:

- Every `check_every` steps it reads `optimizer.loss_scale` and
  `optimizer.nonfinite_counts()` (one host sync per check, none per step).
- A layer's *streak* grows by the number of new non-finite steps of its
  variables (the most of any one of them) at a check where the scale is at
  its floor; a check where the layer had none, or where the scale is above the
  floor, ends its streak.
- A streak of `k` or more promotes the layer (`mpt_keras.precision.promote`):
  a rule for its exact path goes first in the manifest (first match wins),
  the manifest is applied to the model and the train function rebuilt
  (Keras 3 `fit` looks `model.train_function` up at every step, so the next
  step is traced with the new dtypes; weights and optimizer state are kept).
- Each promotion is logged (WARNING), written as TensorBoard text under
  `log_dir/auto_promote` if `log_dir` is given, and the updated manifest is
  written to `manifest_path` if given, ready for `mpt-train --manifest`.

A forward overflow makes the loss non-finite, so every layer upstream and
downstream of it gets non-finite gradients too, and all of them are promoted
together; `mpt_keras.calibration.calibrate.calibrate` finds the one layer. A layer
already float32 is not promoted further (logged once). A layer is the deepest
one owning the variable (`block_0/mlp_up` for `block_0/mlp_up/kernel`).
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from mpt_keras.errors import UserInputError
from mpt_keras.files import write_text_atomic
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.promote import Promotion, promote
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)


class AutoPromote(GlobalStepCallback):
    """Promotes layers whose gradients stay non-finite with the loss scale at its floor.

    See the module docstring for the rule. The model's optimizer must be a
    `mpt_keras.LossScaleOptimizer`, and `manifest` the one applied to the model.

    Args:
        manifest: The manifest the model was built with; promotions are
            rules put before its own.
        k: Non-finite steps at the floor, in consecutive checks, that promote
            a layer.
        check_every: Steps between checks.
        manifest_path: Where the updated manifest is written; `None`: nowhere.
        log_dir: Where a TensorBoard text summary of each promotion goes
            (`<log_dir>/auto_promote`); `None`: logged only.

    Attributes:
        manifest: The current manifest, promotions included.
        promotions: `(step, layer path, old policy, new policy)` of each promotion.

    Example:

        manifest = PrecisionManifest("mixed_float16")
        manifest.apply(model)
        model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
        promote = AutoPromote(manifest, k=3, check_every=10, manifest_path="/tmp/m.json")
        model.fit(x, y, callbacks=[promote])
        promote.promotions  # [(40, 'big', 'mixed_float16', 'mixed_bfloat16')]
    """

    def __init__(
        self,
        manifest: PrecisionManifest,
        k: int = 3,
        check_every: int = 10,
        manifest_path: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
    ):
        super().__init__()
        for name, value in (("k", k), ("check_every", check_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserInputError(
                    f"AutoPromote {name}: must be an integer >= 1, received {value!r}"
                )
        self.manifest = manifest
        self.k = k
        self.check_every = check_every
        self.manifest_path = manifest_path
        self.log_dir = log_dir
        self.promotions: list[tuple[int, str, str, str]] = []
        self._last_counts: dict[str, int] = {}
        self._last_check = 0
        self._streaks: dict[str, int] = {}
        self._owners: dict[str, str] = {}
        self._writer = None
        self._at_float32: set[str] = set()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        optimizer = self.model.optimizer
        if not isinstance(optimizer, LossScaleOptimizer):
            raise UserInputError(
                f"AutoPromote: the model's optimizer is {type(optimizer).__name__}. "
                "Allowed: mpt_keras.LossScaleOptimizer"
            )
        for path, layer in iter_layers(self.model):
            # Depth first, so a nested layer overrides the block holding it.
            for variable in layer.trainable_weights:
                self._owners[variable.path] = path
        self._last_counts = optimizer.nonfinite_counts()
        self._last_check = self.global_step
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "auto_promote"))

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        # Not a modulo: with steps_per_execution > 1 the step jumps.
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
        )
        for promotion in promotions:
            message = self._message(promotion)
            self.promotions.append((self.global_step, promotion.path, promotion.old, promotion.new))
            self._streaks[promotion.path] = 0
            _LOGGER.warning("AutoPromote %s", message)
            if self._writer is not None:
                with self._writer.as_default():
                    tf.summary.text("auto_promote", message, step=self.global_step)
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

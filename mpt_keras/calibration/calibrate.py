"""`calibrate`: each site is recorded as the model runs in float32 on real batches, then run
alone on its recorded inputs in each low precision, the rest float32: about `2 * steps` passes
per nesting level, `training=False`. The default is the policy most layers got; safe defaults
(outputs, normalization) stay float32.

Example:

    result = calibrate(model, (features, labels), keras.losses.MeanSquaredError(), steps=4)
    result.manifest.default            # 'mixed_float16'
    result.statistics["layers"]["dense"]["reason"]
    # 'range fits float16, error 0.00028 <= 0.01 -> mixed_float16'
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mpt_keras import compat
from mpt_keras.calibration import inputs, measurement
from mpt_keras.calibration.decisions import (
    CalibrationThresholds,
    Decider,
    Decision,
    GroupFigures,
    tied_reason,
    unmeasured_reason,
)
from mpt_keras.calibration.float8 import Float8Layer, Float8Recorder, decide_float8
from mpt_keras.calibration.float8_speed import FLOAT8_SPEEDS, SpeedJudge
from mpt_keras.calibration.result import CalibrationResult, CalibrationStatistics, LayerStatistics
from mpt_keras.calibration.rules import calibrated_manifest, exact_rule
from mpt_keras.calibration.sites import CalibrationSites, Group
from mpt_keras.calibration.statistics import (
    OutputErrors,
    VariableGradients,
    activation_statistics,
    layer_gradients,
    magnitudes,
)
from mpt_keras.checks import check_choice, check_number, refusal
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.float8 import FLOAT8_LAYER_CLASSES
from mpt_keras.precision.hand_back import hand_back, hand_back_of
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.names import FLOAT8
from mpt_keras.precision.report import PrecisionReport


def calibrate(
    model_or_factory: keras.Model | Callable[[], keras.Model],
    data: Any,
    loss: keras.losses.Loss | Callable[[Any, Any], Any],
    steps: int = 8,
    seed: int = 0,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
    initial_scale: float = 2.0**15,
    batch_size: int = 32,
    float8: bool = False,
    float8_speed: str = "measure",
) -> CalibrationResult:
    """Measures a model in float32 on `steps` batches and decides a manifest.

    Args:
        model_or_factory: A float32 model (built on the first batch if needed), or a
            no-argument function returning one.
        data: A `tf.data.Dataset` of `(x, y[, sample_weight])` batches, or a tuple of arrays
            (`x` an array or dict of arrays) shuffled with `seed` into `steps` x `batch_size`.
        loss: A `keras.losses.Loss` or its name, or `loss(y_true, y_pred)` per example; for a
            model of several outputs, a dict (by output name) or list of those, or one for all.
        initial_scale: The loss scale a float16 run starts with.
        float8: Give recommended Dense/EinsumDense a float8 rule (emulated, slower, without
            float8 units).
        float8_speed: With `float8`, `measure`: recommend float8 only where this device's
            float8 GEMMs of the layer's shape are measured faster (`calibration.float8_speed`;
            never on a CPU); `ignore`: by the numbers alone (calibrating for another device).

    Returns:
        The statistics and manifest; deterministic in data and seed.

    Raises:
        UserInputError: For bad arguments or data, or float32 outputs not finite.
    """
    check_number("steps", steps, minimum=1, integer=True)
    if not isinstance(float8, bool):
        raise refusal("float8", repr(float8), "True or False")
    check_choice("float8_speed", float8_speed, FLOAT8_SPEEDS)
    check_number("initial_scale", initial_scale, above=0)
    loss = inputs.as_loss(loss)
    model = inputs.as_model(model_or_factory)
    batches = list(inputs.batches(data, steps, seed, batch_size))
    if not model.built:
        model(batches[0][0], training=False)
    sites = CalibrationSites(model)
    # Put back as found: each layer's policy, and what it hands its outputs back to.
    saved_policies = [
        (layer, layer.dtype_policy, hand_back_of(layer)) for _, layer in iter_layers(model)
    ]
    try:
        # On a batch: a subclassed model's call shows which layers make its outputs.
        float32 = PrecisionManifest(default="float32").apply(model, inputs=batches[0][0])
        speed = float8 and float8_speed == "measure"
        calibration = _Calibration(model, sites, float32, thresholds, initial_scale, float8, speed)
        return calibration.run(batches, loss, seed)
    finally:
        for layer, policy, handed_back in saved_policies:
            compat.replace_dtype_policy(layer, policy)
            hand_back(layer, handed_back)


class _Calibration:
    def __init__(
        self,
        model: keras.Model,
        sites: CalibrationSites,
        float32_report: PrecisionReport,
        thresholds: CalibrationThresholds,
        initial_scale: float,
        float8: bool,
        float8_speed: bool,
    ):
        self._model = model
        self._sites = sites
        self._thresholds = thresholds
        self._scale = initial_scale
        self._float8_rules_asked = float8
        self._float8_speed = float8_speed
        self._safe_defaults = {
            layer.path: exact_rule("float32", layer.path, layer.decided_by)
            for layer in float32_report.layers
            if layer.decided_by.startswith("safe default")
        }
        # Per site a safe default keeps float32: why.
        self._kept = {
            site.path: self._safe_defaults[site.path].reason
            for site in sites.sites
            if site.path in self._safe_defaults
        }
        self._decider = Decider(thresholds, initial_scale, self._kept)
        self._float8_candidates = {
            site.path: site.layer
            for site in sites.sites
            if type(site.layer) in FLOAT8_LAYER_CLASSES and site.layer.built
        }
        self._float8 = Float8Recorder(list(self._float8_candidates.items()))
        self._lead: dict[str, str] = {}  # Per site path, its group's lead's.

    def run(self, batches: list[measurement.Batch], loss, seed: int) -> CalibrationResult:
        with self._sites.recording():
            for features, _, _ in batches:
                self._model(features, training=False)
        gradients = measurement.gradient_statistics(
            self._model, self._sites, self._float8, batches, loss, self._scale
        )
        diagnosis = measurement.diagnosis(self._model, self._sites, batches, loss, gradients)
        values = {site.path: magnitudes(site.outputs()) for site in self._sites.sites}
        default, decisions, errors = self._decide_groups(values, gradients)
        layers = {
            site.path: LayerStatistics(
                type(site.layer).__name__,
                activation_statistics(values[site.path]),
                layer_gradients(g for g in gradients.values() if g.layer == site.path),
                errors.get(site.path),
                decisions[site.path],
            )
            for site in self._sites.sites
        }
        float8_layers = self._float8_layers(decisions, default)
        statistics = CalibrationStatistics(
            model=self._model.name,
            steps=len(batches),
            seed=seed,
            initial_scale=self._scale,
            thresholds=self._thresholds,
            default=default,
            layers=layers,
            gradients=gradients,
            diagnosis=diagnosis,
            float8=self._float8_rules_asked,
            float8_layers=float8_layers,
        )
        manifest = calibrated_manifest(
            self._model,
            default,
            decisions,
            self._safe_defaults,
            float8_layers,
            self._float8_candidates,
        )
        return CalibrationResult(statistics.to_json(), manifest)

    def _decide_groups(
        self, values: dict[str, np.ndarray], gradients: dict[str, VariableGradients]
    ) -> tuple[str, dict[str, Decision], dict[str, OutputErrors]]:
        """The default, each site's decision, each measured group's errors (by lead)."""
        groups = self._sites.groups()
        decided: dict[str, Decision] = {}
        figures: dict[str, GroupFigures] = {}
        errors: dict[str, OutputErrors] = {}
        for group in groups:
            lead, paths = group.lead.path, [member.path for member in group.members]
            self._lead.update(dict.fromkeys(paths, lead))
            figures[lead] = GroupFigures(
                activation_statistics(np.concatenate([values[path] for path in paths])),
                layer_gradients(g for g in gradients.values() if g.layer in paths),
            )
            if unmeasured_reason(group) is None:
                errors[lead] = measurement.output_errors(group)
                figures[lead] = dataclasses.replace(figures[lead], errors=errors[lead])
                decided[lead] = self._decider.measured(
                    group, figures[lead], self._sites.holds_sites(group.lead)
                )
        counts = collections.Counter(
            decided[self._lead[path]].policy
            for path in values
            if path not in self._kept and self._lead[path] in decided
        ).most_common(1)
        default = counts[0][0] if counts else "mixed_float16"
        decisions = {}
        for group in groups:
            lead = group.lead.path
            if lead not in decided:
                decided[lead] = self._decider.unmeasured(group, figures[lead], default)
            for member in group.members:
                decisions[member.path] = _member_decision(group, member.path, decided[lead])
        return default, {site.path: decisions[site.path] for site in self._sites.sites}, errors

    def _float8_layers(
        self, decisions: dict[str, Decision], default: str
    ) -> dict[str, Float8Layer]:
        """Per Dense and EinsumDense path, its float8 decision."""
        limits = self._thresholds
        speed = None
        if self._float8_speed:
            compute_dtype = keras.DTypePolicy(default).compute_dtype
            speed = SpeedJudge(compute_dtype, limits.min_float8_speedup).judge
        decided = {}
        for path, figures in self._float8.figures().items():
            policy = decisions[path].policy
            if self._lead[path] != path:
                why = f"follows {self._lead[path]}"
            else:
                why = self._kept.get(path, "for its numbers")
            recommended, reason = decide_float8(
                figures,
                policy,
                why,
                default,
                limits.max_float8_saturated_fraction,
                limits.max_float8_underflowed_fraction,
                speed,
            )
            chosen = FLOAT8 if recommended and self._float8_rules_asked else policy
            decided[path] = Float8Layer(figures, chosen, recommended, reason)
        return decided


def _member_decision(group: Group, path: str, decision: Decision) -> Decision:
    if path == group.lead.path:
        return decision
    return Decision(decision.policy, tied_reason(group.lead.path, decision.policy))

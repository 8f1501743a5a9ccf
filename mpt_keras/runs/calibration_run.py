"""`run_calibration` (`mpt-calibrate`): a run config's model calibrated."""

from __future__ import annotations

import dataclasses
import os

from mpt_keras.calibration.calibrate import calibrate
from mpt_keras.calibration.decisions import CalibrationThresholds
from mpt_keras.calibration.result import CalibrationResult
from mpt_keras.config import TrainConfig
from mpt_keras.files import check_writable_dir, write_text_atomic
from mpt_keras.runs.precision_plan import build_model
from mpt_keras.runs.resolution import resolve_components


def run_calibration(
    config: TrainConfig,
    output: str | os.PathLike,
    stats_output: str | os.PathLike | None = None,
    steps: int = 8,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
    float8: bool = False,
    float8_speed: str = "measure",
) -> CalibrationResult:
    """Calibrates on the run's first `steps` train batches; writes the manifest and statistics.

    The model is built as `run_training`'s, in float32, at `loss_scale.initial_scale`.
    `float8`, `float8_speed`: as `calibrate`'s.
    `stats_output` defaults to `<output stem>.stats.json`.
    """
    float32_config = dataclasses.replace(config, precision="float32", manifest=None)
    components = resolve_components(float32_config)
    data = components.data()
    model, _, _ = build_model(float32_config, components, data)
    batches = data.train_batches(
        config.data.batch_size, config.seed, shuffle_buffer=config.data.shuffle_buffer
    )
    result = calibrate(
        model,
        batches,
        components.loss,
        steps=steps,
        seed=config.seed,
        thresholds=thresholds,
        initial_scale=float(config.loss_scale.initial_scale),
        float8=float8,
        float8_speed=float8_speed,
    )
    stats_path = stats_output or os.path.splitext(os.fspath(output))[0] + ".stats.json"
    for what, path, text in (
        ("--output directory", output, result.manifest.to_json()),
        ("--stats_output directory", stats_path, result.to_json()),
    ):
        check_writable_dir(os.path.dirname(os.fspath(path)) or ".", what, min_free_bytes=0)
        write_text_atomic(path, text)
    return result

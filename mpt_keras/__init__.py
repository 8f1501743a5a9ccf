"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow and JAX.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.

Each public name is imported from its module on first use (PEP 562), so that
`mpt_keras.config` and `mpt_keras.config.components` load, and a bad config fails,
without importing TensorFlow. Keras finds the classes our files hold (the
`LossScaleOptimizer` in a `model.keras`, the reference models' layers) once
they are registered, and compiles a model with float16 layers with our
`LossScaleOptimizer` once `mpt_keras.scaling.compile_hook` hooks `model.compile`:
`import mpt_keras` does both when Keras is imported already (`import keras`
first, as usual), and so does the first use of any public name that imports
Keras.
"""

import importlib
import sys
from typing import TYPE_CHECKING, Any

# The modules whose classes Keras must find by registered name to load our files.
_SERIALIZABLES = ("mpt_keras.scaling.optimizer", "mpt_keras.reliability.guards", "mpt_keras.models")

if TYPE_CHECKING:  # what editors and type checkers see; loaded lazily below
    from mpt_keras.calibration.calibrate import calibrate
    from mpt_keras.calibration.decisions import CalibrationThresholds
    from mpt_keras.calibration.result import CalibrationResult
    from mpt_keras.config import TrainConfig, resolve_config
    from mpt_keras.errors import PeerFailedError, RunStoppedError, UserInputError
    from mpt_keras.precision.hardware import HardwareProbe, probe_hardware, resolve_auto_policy
    from mpt_keras.precision.manifest import PrecisionManifest
    from mpt_keras.precision.policies import global_policy
    from mpt_keras.precision.report import PrecisionReport, precision_report
    from mpt_keras.precision.rules import Rule
    from mpt_keras.reliability.auto_promote import AutoPromote
    from mpt_keras.reliability.guards import BadBatchLimit, DivergenceGuard, ScaledLearningRate
    from mpt_keras.runs.assembly import plan_precision
    from mpt_keras.runs.calibration_run import run_calibration
    from mpt_keras.runs.canary import CanaryResult, CanaryThresholds, run_canary, train_with_canary
    from mpt_keras.runs.serving import export_saved_model, save_for_serving
    from mpt_keras.runs.training import Runtime, run_training
    from mpt_keras.runs.validation import run_validation, validate
    from mpt_keras.scaling.health import StepHealth
    from mpt_keras.scaling.optimizer import LossScaleOptimizer
    from mpt_keras.scaling.settings import LossScaleSettings
    from mpt_keras.telemetry.diagnosis import NonfiniteReport, diagnose_nonfinite
    from mpt_keras.telemetry.metrics_csv import MetricsCsv
    from mpt_keras.telemetry.monitor import MixedPrecisionMonitor
    from mpt_keras.telemetry.prometheus import PrometheusExporter
    from mpt_keras.validation.report import ValidationReport
    from mpt_keras.validation.thresholds import Thresholds

_HOMES = {
    "AutoPromote": "reliability.auto_promote",
    "BadBatchLimit": "reliability.guards",
    "CalibrationResult": "calibration.result",
    "CalibrationThresholds": "calibration.decisions",
    "CanaryResult": "runs.canary",
    "CanaryThresholds": "runs.canary",
    "DivergenceGuard": "reliability.guards",
    "HardwareProbe": "precision.hardware",
    "LossScaleOptimizer": "scaling.optimizer",
    "LossScaleSettings": "scaling.settings",
    "MetricsCsv": "telemetry.metrics_csv",
    "MixedPrecisionMonitor": "telemetry.monitor",
    "NonfiniteReport": "telemetry.diagnosis",
    "PeerFailedError": "errors",
    "PrecisionManifest": "precision.manifest",
    "PrecisionReport": "precision.report",
    "PrometheusExporter": "telemetry.prometheus",
    "Rule": "precision.rules",
    "RunStoppedError": "errors",
    "Runtime": "runs.training",
    "ScaledLearningRate": "reliability.guards",
    "StepHealth": "scaling.health",
    "Thresholds": "validation.thresholds",
    "TrainConfig": "config",
    "UserInputError": "errors",
    "ValidationReport": "validation.report",
    "calibrate": "calibration.calibrate",
    "diagnose_nonfinite": "telemetry.diagnosis",
    "export_saved_model": "runs.serving",
    "global_policy": "precision.policies",
    "plan_precision": "runs.assembly",
    "precision_report": "precision.report",
    "probe_hardware": "precision.hardware",
    "resolve_auto_policy": "precision.hardware",
    "resolve_config": "config",
    "run_calibration": "runs.calibration_run",
    "run_canary": "runs.canary",
    "run_training": "runs.training",
    "run_validation": "runs.validation",
    "save_for_serving": "runs.serving",
    "train_with_canary": "runs.canary",
    "validate": "runs.validation",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'mpt_keras' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mpt_keras.{_HOMES[name]}"), name)
    if "keras" in sys.modules:
        _hook_into_keras()
    globals()[name] = value
    return value


def _hook_into_keras() -> None:
    """Registers our serializable classes and installs the loss-scaling compile hook."""
    for module in _SERIALIZABLES:
        importlib.import_module(module)
    importlib.import_module("mpt_keras.scaling.compile_hook").install()


if "keras" in sys.modules:
    _hook_into_keras()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

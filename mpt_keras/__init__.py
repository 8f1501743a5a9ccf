"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.

Each public name is imported from its module on first use (PEP 562), so that
`mpt_keras.config` and `mpt_keras.components` load, and a bad config fails,
without importing TensorFlow. Keras finds the classes our files hold (the
`LossScaleOptimizer` in a `model.keras`, the reference models' layers) once
they are registered, and compiles a model with float16 layers with our
`LossScaleOptimizer` once `mpt_keras.autoscale` hooks `model.compile`:
`import mpt_keras` does both when Keras is imported already (`import keras`
first, as usual), and so does the first use of any public name that imports
Keras.
"""

import importlib
import sys
from typing import Any

# The modules whose classes Keras must find by registered name to load our files.
_SERIALIZABLES = ("mpt_keras.loss_scale_optimizer", "mpt_keras.guards", "mpt_keras.models")

_HOMES = {
    "AutoPromote": "auto_promote",
    "BadBatchLimit": "guards",
    "CalibrationResult": "calibration",
    "CalibrationThresholds": "calibration",
    "CanaryResult": "canary",
    "CanaryThresholds": "canary",
    "DivergenceGuard": "guards",
    "HardwareProbe": "precision.hardware",
    "LossScaleOptimizer": "loss_scale_optimizer",
    "LossScaleSettings": "loss_scale_settings",
    "MetricsCsv": "metrics_csv",
    "MixedPrecisionMonitor": "monitor",
    "NonfiniteReport": "diagnosis",
    "PeerFailedError": "errors",
    "PrecisionManifest": "precision.manifest",
    "PrecisionReport": "precision.report",
    "PrometheusExporter": "prometheus",
    "Rule": "precision.manifest",
    "RunStoppedError": "errors",
    "Runtime": "training",
    "ScaledLearningRate": "guards",
    "StepHealth": "step_health",
    "Thresholds": "thresholds",
    "TrainConfig": "config",
    "UserInputError": "errors",
    "ValidationReport": "validation",
    "calibrate": "calibration",
    "diagnose_nonfinite": "diagnosis",
    "export_saved_model": "serving",
    "global_policy": "precision.policies",
    "plan_precision": "runs",
    "precision_report": "precision.report",
    "probe_hardware": "precision.hardware",
    "resolve_auto_policy": "precision.hardware",
    "resolve_config": "config",
    "run_calibration": "runs",
    "run_canary": "canary",
    "run_training": "training",
    "run_validation": "validation",
    "save_for_serving": "serving",
    "train_with_canary": "canary",
    "validate": "validation",
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
    importlib.import_module("mpt_keras.autoscale").install()


if "keras" in sys.modules:
    _hook_into_keras()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

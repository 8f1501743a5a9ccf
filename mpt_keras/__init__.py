"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.

Each public name is imported from its module on first use (PEP 562), so that
`mpt_keras.config` and `mpt_keras.components` load, and a bad config fails,
without importing TensorFlow.
"""

import importlib
from typing import Any

_HOMES = {
    "AutoPromote": "auto_promote",
    "BadBatchLimit": "guards",
    "CalibrationResult": "calibration",
    "CalibrationThresholds": "calibration",
    "CanaryResult": "canary",
    "CanaryThresholds": "canary",
    "DivergenceGuard": "guards",
    "HardwareProbe": "policies",
    "LossScaleOptimizer": "loss_scale_optimizer",
    "ManifestReport": "manifest",
    "MixedPrecisionMonitor": "monitor",
    "PeerFailedError": "errors",
    "PrecisionManifest": "manifest",
    "Rule": "manifest",
    "RunStoppedError": "errors",
    "Runtime": "training",
    "ScaledLearningRate": "guards",
    "Thresholds": "thresholds",
    "TrainConfig": "config",
    "UserInputError": "errors",
    "ValidationReport": "validation",
    "calibrate": "calibration",
    "export_saved_model": "serving",
    "format_precision_table": "runs",
    "global_policy": "policies",
    "plan_precision": "runs",
    "precision_report": "policies",
    "probe_hardware": "policies",
    "resolve_auto_policy": "policies",
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
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

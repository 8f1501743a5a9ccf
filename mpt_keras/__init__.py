"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.
"""

from mpt_keras.auto_promote import AutoPromote
from mpt_keras.calibration import CalibrationResult, CalibrationThresholds, calibrate
from mpt_keras.canary import CanaryResult, CanaryThresholds, run_canary, train_with_canary
from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import PeerFailedError, RunStoppedError, UserInputError
from mpt_keras.guards import BadBatchLimit, DivergenceGuard, ScaledLearningRate
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.manifest import ManifestReport, PrecisionManifest, Rule
from mpt_keras.monitor import MixedPrecisionMonitor
from mpt_keras.policies import (
    HardwareProbe,
    global_policy,
    precision_report,
    probe_hardware,
    resolve_auto_policy,
)
from mpt_keras.training import (
    Runtime,
    format_precision_table,
    plan_precision,
    run_calibration,
    run_training,
)
from mpt_keras.validation import Thresholds, ValidationReport, run_validation, validate

__all__ = [
    "AutoPromote",
    "BadBatchLimit",
    "CalibrationResult",
    "CalibrationThresholds",
    "CanaryResult",
    "CanaryThresholds",
    "DivergenceGuard",
    "HardwareProbe",
    "LossScaleOptimizer",
    "ManifestReport",
    "MixedPrecisionMonitor",
    "PeerFailedError",
    "PrecisionManifest",
    "Rule",
    "RunStoppedError",
    "Runtime",
    "ScaledLearningRate",
    "Thresholds",
    "TrainConfig",
    "UserInputError",
    "ValidationReport",
    "calibrate",
    "format_precision_table",
    "global_policy",
    "plan_precision",
    "precision_report",
    "probe_hardware",
    "resolve_auto_policy",
    "resolve_config",
    "run_calibration",
    "run_canary",
    "run_training",
    "run_validation",
    "train_with_canary",
    "validate",
]

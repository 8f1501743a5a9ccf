"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.
"""

from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import UserInputError
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
from mpt_keras.training import Runtime, format_precision_table, plan_precision, run_training

__all__ = [
    "HardwareProbe",
    "LossScaleOptimizer",
    "ManifestReport",
    "MixedPrecisionMonitor",
    "PrecisionManifest",
    "Rule",
    "Runtime",
    "TrainConfig",
    "UserInputError",
    "format_precision_table",
    "global_policy",
    "plan_precision",
    "precision_report",
    "probe_hardware",
    "resolve_auto_policy",
    "resolve_config",
    "run_training",
]

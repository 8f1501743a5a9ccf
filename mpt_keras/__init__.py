"""mpt_keras: mixed-precision training for Keras 3 on TensorFlow.

Train with float16 or bfloat16 compute while float32 master weights, optimizer
state and numerically sensitive layers stay in float32, and see what the
precision choice does.
"""

from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import UserInputError
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.monitor import MixedPrecisionMonitor
from mpt_keras.policies import global_policy, precision_report
from mpt_keras.training import Runtime, run_training

__all__ = [
    "LossScaleOptimizer",
    "MixedPrecisionMonitor",
    "Runtime",
    "TrainConfig",
    "UserInputError",
    "global_policy",
    "precision_report",
    "resolve_config",
    "run_training",
]

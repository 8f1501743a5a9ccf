"""Run configuration: frozen dataclasses parsed strictly from JSON, and where components come from.

    train_config.py  TrainConfig and its sections, resolve_config (defaults, a
                     file, overrides, flags), the allowed names of each key
    components.py    a factory reference (`package.module:attribute`) resolved,
                     imported and bound to its options before anything runs

Imports no TensorFlow, so that a bad config fails in a second.
"""

from mpt_keras.config.train_config import (
    DEFAULT_DATASET,
    DEFAULT_MODEL,
    DIVERGENCE_ACTIONS,
    JIT_COMPILE,
    LR_SCHEDULES,
    MODEL_NAMES,
    OPTIMIZERS,
    SOURCE_KEYS,
    STRATEGIES,
    ComponentConfig,
    DataConfig,
    DivergenceConfig,
    LossScaleConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    check_files,
    resolve_config,
)

__all__ = [
    "DEFAULT_DATASET",
    "DEFAULT_MODEL",
    "DIVERGENCE_ACTIONS",
    "JIT_COMPILE",
    "LR_SCHEDULES",
    "MODEL_NAMES",
    "OPTIMIZERS",
    "SOURCE_KEYS",
    "STRATEGIES",
    "ComponentConfig",
    "DataConfig",
    "DivergenceConfig",
    "LossScaleConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "check_files",
    "resolve_config",
]

"""Run configuration: frozen dataclasses parsed strictly from JSON; no TensorFlow.

names.py               the keys' allowed names and fixed values
key_checks.py          a value checked, refused naming its key
component_sections.py  DataConfig, ModelConfig, ComponentConfig
optimizer_sections.py  OptimizerConfig, DivergenceConfig
schema.py              the sections' JSON form: parsed, written, merged
train_config.py        TrainConfig
resolve.py             resolve_config (a file, overrides, flags), check_files
components.py          `package.module:attribute` factories imported and bound
"""

from mpt_keras.backend.names import STRATEGIES
from mpt_keras.config.component_sections import ComponentConfig, DataConfig, ModelConfig
from mpt_keras.config.names import (
    DEFAULT_DATASET,
    DEFAULT_MODEL,
    DIVERGENCE_ACTIONS,
    JIT_COMPILE,
    LR_SCHEDULES,
    MODEL_NAMES,
    OPTIMIZERS,
    SOURCE_KEYS,
)
from mpt_keras.config.optimizer_sections import DivergenceConfig, OptimizerConfig
from mpt_keras.config.resolve import check_files, resolve_config
from mpt_keras.config.train_config import TrainConfig

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
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "check_files",
    "resolve_config",
]

"""The allowed names and fixed values of config keys: one list per key, no TensorFlow."""

from __future__ import annotations

import re

JIT_COMPILE = ("auto", "true", "false")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")
DIVERGENCE_ACTIONS = ("rollback", "promote", "stop")
MODEL_NAMES = ("mlp", "cnn", "transformer_lm")
SOURCE_KEYS = ("name", "factory", "file")
DEFAULT_MODEL = "cnn"
DEFAULT_DATASET = "mpt_digits"
# NumPy's legacy seeding, which `keras.utils.set_random_seed` calls, takes 32 bits.
MAX_SEED = 2**32 - 1
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

"""On Keras' JAX backend with TensorFlow not importable (tests/test_jax_backend.py's child)."""

from __future__ import annotations

import importlib
import sys

import keras
import pytest

import mpt_keras

# The public names that load on JAX so far; the rest say in one line that they need TensorFlow.
ON_JAX = (
    "BadBatchLimit",
    "DivergenceGuard",
    "HardwareProbe",
    "LossScaleOptimizer",
    "LossScaleSettings",
    "PeerFailedError",
    "PrecisionManifest",
    "PrecisionReport",
    "Rule",
    "RunStoppedError",
    "ScaledLearningRate",
    "StepHealth",
    "Thresholds",
    "ValidationReport",
    "export_saved_model",
    "TrainConfig",
    "UserInputError",
    "global_policy",
    "precision_report",
    "probe_hardware",
    "resolve_auto_policy",
    "resolve_config",
    "save_for_serving",
)


def test_this_process_runs_jax_and_cannot_import_tensorflow():
    assert keras.backend.backend() == "jax"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tensorflow")
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("name", ON_JAX)
def test_public_names_served_on_jax_load_without_tensorflow(name):
    assert getattr(mpt_keras, name) is not None
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("name", sorted(set(mpt_keras.__all__) - set(ON_JAX)))
def test_the_other_public_names_say_in_one_line_that_they_need_tensorflow(name):
    with pytest.raises(ImportError) as raised:
        getattr(mpt_keras, name)
    message = str(raised.value)
    assert "\n" not in message
    assert f"mpt_keras.{name}" in message and "TensorFlow" in message and "jax" in message

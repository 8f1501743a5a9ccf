"""Fixtures shared by the test files."""

import os

# As the launchers do (trainers/__init__.py): CPU memory statistics on every
# CPU, so the monitor's and the benchmarks' memory figures are tested here too.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras
import pytest
import tensorflow as tf


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by a test session; embedded datasets prepare on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture
def no_memory_statistics(monkeypatch):
    """Makes every device answer as one whose allocator keeps no statistics.

    As TensorFlow's default CPU allocator does on a CPU without oneDNN.
    """

    def untracked(device):
        raise ValueError(f"Allocator stats not available for device '{device}'")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", untracked)


@pytest.fixture
def tiny_gpt2():
    """Builds tiny keras_hub GPT-2 backbones from arguments (no preset, no network)."""
    import keras_hub

    def build(num_layers: int = 2) -> keras.Model:
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=num_layers,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
        )

    return build


@pytest.fixture(autouse=True)
def _restore_keras_state():
    """Each test starts from Keras' defaults: float32 policy, fresh name scopes."""
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()

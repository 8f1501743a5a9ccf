"""Fixtures shared by the test files."""

import keras
import pytest


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by a test session; embedded datasets prepare on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture(autouse=True)
def _restore_keras_state():
    """Each test starts from Keras' defaults: float32 policy, fresh name scopes."""
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()

"""Fixtures shared by the test files."""

import pytest


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by a test session; embedded datasets prepare on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))

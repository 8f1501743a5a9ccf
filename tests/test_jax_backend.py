"""Runs the backend-neutral tests, and the JAX-only ones, on Keras' JAX backend.

Keras picks its backend once per process, so they run in one child pytest with
`KERAS_BACKEND=jax` and no TensorFlow (`launchers.without_tensorflow`: `import tensorflow`
fails there): every module they import must load without TensorFlow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launchers import without_tensorflow

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_the_jax_backend_passes_the_neutral_and_jax_tests(tmp_path):
    env = {
        **without_tensorflow(),
        "KERAS_BACKEND": "jax",
        # Two CPU devices, for keras.distribution.DataParallel.
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    report = tmp_path / "jax.xml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-q",
            f"--junitxml={report}",
            os.path.join(TESTS, "any_backend"),
            os.path.join(TESTS, "jax_backend"),
        ],
        cwd=os.path.dirname(TESTS),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]

"""Runs a test module's function in a child Python, on two logical CPU devices if asked.

Two replicas need the CPU split before TensorFlow initializes its devices,
which the pytest process may have done already; a multi-worker run needs a
process per worker. The one helper for both: the child imports the test module
(the tests directory is on its path), calls the function with the given string
arguments and prints its result as JSON, which `run_child` returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_TESTS_DIR = Path(__file__).resolve().parent
_CHILD = """
import json, sys
if {virtual_cpus}:
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * {virtual_cpus}
    )
import {module}
print(json.dumps({module}.{function}(*sys.argv[1:])))
"""


def run_child(
    module: str, function: str, *args: str, virtual_cpus: int = 2, timeout: float = 600
) -> Any:
    """`module.function(*args)` in a child process; its JSON result.

    Args:
        module: A module of the tests directory, e.g. `"test_monitor"`.
        function: The name of a function of it returning something JSON can hold.
        *args: Its arguments, as strings.
        virtual_cpus: Logical CPU devices to split the CPU into first; 0: none.
        timeout: Seconds after which the child counts as hung (not a timing
            assertion: only a hang reaches it).

    Raises:
        AssertionError: The child failed; the message ends with its stderr.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_TESTS_DIR.parent), str(_TESTS_DIR), env.get("PYTHONPATH", "")]
    )
    code = _CHILD.format(virtual_cpus=virtual_cpus, module=module, function=function)
    child = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])

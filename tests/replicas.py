"""Child processes for tests: two logical CPUs in one process, or a cluster of workers.

Two replicas need the CPU split before TensorFlow initializes its devices,
which the pytest process may have done already: `run_child` runs a test
module's function in a child Python (the tests directory on its path), on two
logical CPU devices, and returns what it printed as JSON. A multi-worker run
needs a process per worker: `start_workers` starts one command per worker of a
cluster on loopback ports, each with its `TF_CONFIG`, and `communicate_all`
waits for them all (killing all if one hangs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
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
    code = _CHILD.format(virtual_cpus=virtual_cpus, module=module, function=function)
    child = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def child_env(**changes: str) -> dict[str, str]:
    """This process's environment for a child: TensorFlow quiet, no `TF_CONFIG`, the
    repository and the tests directory importable, and `changes`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_TESTS_DIR.parent), str(_TESTS_DIR), env.get("PYTHONPATH", "")]
    )
    env.update(changes)
    return env


def loopback_addresses(count: int = 2) -> list[str]:
    """`count` addresses `127.0.0.1:port` of ports free now, for a cluster's workers."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return [f"127.0.0.1:{port}" for port in ports]


def start_workers(
    command: Sequence[str],
    count: int = 2,
    *,
    env: Mapping[str, str] | None = None,
    stdout: Any = subprocess.PIPE,
) -> list[subprocess.Popen]:
    """Starts `command` once per worker of a `count`-worker cluster on loopback ports.

    Args:
        command: The program and its arguments, the same for every worker
            (run from the repository's root).
        count: Workers in the cluster.
        env: The workers' environment (`child_env()` if omitted), to which
            each gets its `TF_CONFIG`.
        stdout: Where the workers' stdout goes; stderr is piped, as text.

    Returns:
        The processes, worker 0 (the chief) first.
    """
    cluster = {"worker": loopback_addresses(count)}
    processes = []
    for index in range(count):
        worker_env = dict(child_env() if env is None else env)
        worker_env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        processes.append(
            subprocess.Popen(
                list(command),
                cwd=_TESTS_DIR.parent,
                env=worker_env,
                stdout=stdout,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def communicate_all(
    processes: Sequence[subprocess.Popen], timeout: float = 400
) -> list[tuple[int, str, str]]:
    """Waits for every process; `(returncode, stdout, stderr)` of each.

    Args:
        processes: As `start_workers` returns them.
        timeout: Seconds after which a process counts as hung (not a timing
            assertion: only a hang reaches it); then all are killed and
            `subprocess.TimeoutExpired` raised.
    """
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append((process.returncode, stdout or "", stderr or ""))
    return results

"""Child processes for tests: two logical CPUs in one process, or a cluster of workers.

Two replicas need the CPU split before TensorFlow initializes its devices,
which the pytest process may have done already: `run_on_two_cpus` runs a test
module's function in this pytest process's two-CPU host, a child Python (the
tests directory on its path) started on first use and kept, and returns what
the function returned, through JSON. A TensorFlow process costs about 8 s of CPU
to start, so the test files that use the host share one xdist group
(`on_two_cpus`), and so one host; their functions build their models under
`two_cpu_strategy()`, the one MirroredStrategy of the process that the
launchers' `mirrored` runs share too (two would number their all-reduces from the
same keys). `run_child` runs a function in a fresh child instead, for tests whose
point is a fresh runtime. A multi-worker run
needs a process per worker: `start_workers` starts one command per worker of a
cluster on loopback ports, each with its `TF_CONFIG`, and `communicate_all`
waits for them all (killing all if one hangs).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

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


on_two_cpus = pytest.mark.xdist_group("two_cpus")  # tests/conftest.py keeps it.
_HOST = """
import importlib, json, sys, traceback
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
replies = open(int(sys.argv[1]), "w")
for line in sys.stdin:
    module, function, args = json.loads(line)
    try:
        reply = {"result": getattr(importlib.import_module(module), function)(*args)}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    keras.config.set_dtype_policy("float32")  # The next function starts from the defaults.
    keras.backend.clear_session(free_memory=False)
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""


class _Host:
    """The child that runs functions on two logical CPUs, one call at a time."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile("w+")
        read, write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOST, str(write)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(),
            pass_fds=(write,),
        )
        os.close(write)
        self.replies = os.fdopen(read)

    def call(self, module: str, function: str, args: Sequence[str], timeout: float) -> Any:
        self.process.stdin.write(json.dumps([module, function, list(args)]) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout)
        line = self.replies.readline() if ready else ""
        if not line:
            self.process.kill()
            what = "died" if ready else "hung"
            raise AssertionError(f"the two-CPU host {what}:\n{self.output()}")
        reply = json.loads(line)
        assert "error" not in reply, f"{reply.get('error')}\n{self.output()}"
        return reply["result"]

    def output(self) -> str:
        """The end of what the host printed."""
        self.log.seek(0)
        return self.log.read()[-4000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


_host: _Host | None = None


def run_on_two_cpus(module: str, function: str, *args: str, timeout: float = 600) -> Any:
    """`module.function(*args)` in the two-CPU host (see the module docstring); what it
    returns, which JSON must hold. Mark the calling test files `on_two_cpus`.

    Raises:
        AssertionError: The function raised (its traceback and the host's output follow),
            or the host died, or hung past `timeout` seconds (not a timing assertion); the
            next call starts a new host.
    """
    global _host
    if _host is None or _host.process.poll() is not None:
        _host = _Host()
        atexit.register(_host.close)
    return _host.call(module, function, args, timeout)


def two_cpu_strategy() -> Any:
    """In the two-CPU host: the process's MirroredStrategy over both CPUs (the launchers')."""
    from mpt_keras.backend.tensorflow.distribute import make_strategy

    return make_strategy("mirrored", virtual_cpus=2)


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

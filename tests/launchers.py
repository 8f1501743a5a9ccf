"""Runs a launcher as a user does, in this process or as its console script.

`launch_in_process("mpt-train", "--config=...")` calls the console script's
entry point (`trainers.train:run`) here, with those arguments and its flags
parsed afresh, and returns what a process would have: the exit status, stdout
and stderr (log lines included). An exception that escapes the launcher is
status "traceback", its traceback in stderr. There is no TensorFlow import to
wait for, so a bad-input case takes milliseconds instead of a process start.

A launch leaves the process as it found it: absl's flags unparsed at their
defaults, the logging levels and handlers, the environment, the global dtype
policy and a cleared Keras session, Python's and NumPy's random states,
`sys.argv` and the kernel's process name (absl names the process after the
program). The launchers define flags of the same names (`--config`,
`--steps`, ...), which absl allows once per process, so only the running
launcher's flags are registered. The launchers restore TensorFlow's op
determinism themselves; CPU devices can be split only before TensorFlow
initializes them, so runs that need that go to a child (tests/replicas.py).

What only a new process shows: TensorFlow's native start-up lines, written to
file descriptor 2 on its first import, which a launcher silences. Each launcher
has one smoke test through `launch_console_script`, the installed script in a
process of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import random
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator

import keras
import numpy as np
from absl import command_name, flags
from absl import logging as absl_logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WITHOUT_TENSORFLOW = os.path.join(REPO, "tests", "without_tensorflow")
# The console scripts of setup.cfg and their modules.
LAUNCHERS = {
    "mpt-train": "trainers.train",
    "mpt-calibrate": "trainers.calibrate",
    "mpt-validate": "trainers.validate",
    "mpt-bench": "trainers.bench",
}
# The loggers whose levels a launch sets (the root one through absl's --verbosity).
_LOGGERS = ("", "absl", "mpt_keras")
# Each imported launcher module's own flags, registered while it runs.
_FLAGS_OF: dict[str, list[flags.Flag]] = {}
# The packages whose modules define program flags (launchers, benchmarks).
_PROGRAM_PACKAGES = ("trainers.", "benchmarks.")
# Flags of other programs, set aside while a launcher runs: name -> (flag, module).
_SET_ASIDE: dict[str, tuple[flags.Flag, str]] = {}


@dataclasses.dataclass(frozen=True)
class Launched:
    """What a launch gave back.

    Attributes:
        status: The exit status, or "traceback" when an exception escaped the
            launcher in this process.
        stdout: What it printed on stdout.
        stderr: What it printed on stderr, log lines and any traceback included.
    """

    status: int | str
    stdout: str
    stderr: str


def launch_in_process(program: str, *argv: str) -> Launched:
    """`program argv` in this process, as its console script runs it.

    Args:
        program: A console script of `LAUNCHERS`, e.g. `"mpt-train"`.
        *argv: Its command-line arguments.

    Returns:
        Its exit status and what it printed.
    """
    stdout, stderr = io.StringIO(), io.StringIO()
    with _process_state_restored(), _logs_to(stderr):
        run = _entry_point(program)  # Its first import sets environment variables.
        sys.argv = [program, *argv]
        flags.FLAGS.unparse_flags()
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                run()
            status: int | str = 0
        except SystemExit as exited:
            status = exited.code or 0
        except Exception:  # What a process would print before it died.
            status = "traceback"
            traceback.print_exc(file=stderr)
        finally:
            flags.FLAGS.unparse_flags()
            _restore_set_aside()
    return Launched(status, stdout.getvalue(), stderr.getvalue())


def launch_console_script(program: str, *argv: str, timeout: float = 300) -> Launched:
    """`program argv` as a user runs it: the installed console script, in its own process.

    Args:
        program: A console script of `LAUNCHERS`, e.g. `"mpt-train"`.
        *argv: Its command-line arguments.
        timeout: Seconds after which the process counts as hung (not a timing
            assertion: only a hang reaches it).

    Returns:
        Its exit status and what it printed.
    """
    script = shutil.which(program) or os.path.join(os.path.dirname(sys.executable), program)
    process = subprocess.run(
        [script, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return Launched(process.returncode, process.stdout, process.stderr)


def without_tensorflow() -> dict[str, str]:
    """This process's environment for a child that runs as on a machine without TensorFlow,
    as the lent GPUs are, and so do its own children (tests/without_tensorflow/sitecustomize.py
    first on `PYTHONPATH`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_WITHOUT_TENSORFLOW, env.get("PYTHONPATH"))))
    return env


def _entry_point(program: str) -> Callable[[], None]:
    """The launcher's `run`, with its flags registered in place of any other program's.

    Every flag a module of `trainers` or `benchmarks` defined (another
    launcher's, `benchmarks.common_flags`', even one of a launcher whose
    import failed half-way) is set aside first, so that the launcher's import
    defines its own; the ones whose names stay free are registered again by
    `_restore_set_aside`.
    """
    module_name = LAUNCHERS[program]
    for name in LAUNCHERS.values():
        if name in sys.modules and name not in _FLAGS_OF:  # Imported without this module.
            _FLAGS_OF[name] = flags.FLAGS.get_flags_for_module(name)
    for name in list(flags.FLAGS):
        module = flags.FLAGS.find_module_defining_flag(name)
        if module and module != module_name and module.startswith(_PROGRAM_PACKAGES):
            _SET_ASIDE[name] = (flags.FLAGS[name], module)
            delattr(flags.FLAGS, name)
    module = importlib.import_module(module_name)  # Defines its flags on first import.
    if module_name not in _FLAGS_OF:
        _FLAGS_OF[module_name] = flags.FLAGS.get_flags_for_module(module_name)
    for flag in _FLAGS_OF[module_name]:
        if flag.name not in flags.FLAGS:
            flags.FLAGS[flag.name] = flag
            # `--help` lists the flags registered by the launcher's module.
            flags.FLAGS.register_flag_by_module(module_name, flag)
    return module.run


def _restore_set_aside() -> None:
    """Registers again the set-aside flags whose names the launcher left free."""
    for name, (flag, module) in list(_SET_ASIDE.items()):
        if name not in flags.FLAGS:
            flags.FLAGS[name] = flag
            flags.FLAGS.register_flag_by_module(module, flag)
            del _SET_ASIDE[name]


@contextlib.contextmanager
def _logs_to(stream: io.StringIO) -> Iterator[None]:
    """Sends absl's log handler, which a launcher logs through, to `stream`.

    The handler writes to the stderr of when absl was imported, not to
    `sys.stderr` of the moment.
    """
    handler = absl_logging.get_absl_handler()
    installed = handler in logging.root.handlers
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    absl_logging.use_absl_handler()  # As absl's app.run does, once per process.
    previous = handler.python_handler.setStream(stream)
    try:
        yield
    finally:
        handler.python_handler.setStream(previous)
        if not installed:
            logging.root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """Restores what a launcher changes in its process, besides flags and logging."""
    argv, environ = sys.argv, dict(os.environ)
    policy = keras.config.dtype_policy()
    python_random, numpy_random = random.getstate(), np.random.get_state()
    process_name = _kernel_process_name()
    try:
        yield
    finally:
        # Without Python's garbage collection, ~0.2 s a launch: a test's
        # teardown does it (tests/conftest.py).
        keras.backend.clear_session(free_memory=False)
        keras.config.set_dtype_policy(policy)
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
        random.setstate(python_random)
        np.random.set_state(numpy_random)
        sys.argv = argv
        if process_name is not None and _kernel_process_name() != process_name:
            command_name.set_kernel_process_name(process_name)


def _kernel_process_name() -> bytes | None:
    """The name `absl.command_name` sets (Linux), or None where there is none to read."""
    try:
        with open("/proc/self/comm", "rb") as comm:
            return comm.read().rstrip(b"\n")
    except OSError:
        return None

"""The benchmarks' result files: what run wrote each (when, which command, what machine).

A result a table of docs/benchmarks.md is made from carries, besides its
`machine` (`harness.machine`), a `run` record: `date` (ISO 8601, UTC),
`command` (quoted for a POSIX shell) and `cpu_flags` (those of `CPU_FLAGS`:
they decide which kernels TensorFlow runs on this CPU).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from mpt_keras.errors import UserInputError

CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_fp16",
)
# The flags of bfloat16 or float16 arithmetic (of CPU_FLAGS): a machine without them emulates.
LOW_PRECISION_CPU_FLAGS = frozenset({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})


def record(command: Sequence[str]) -> dict[str, Any]:
    """The `run` record of a result written now by `command`, as typed (`["mpt-bench", ...]`)."""
    # Here, not at the top: reading results (the docs' tables) needs no TensorFlow.
    from mpt_keras.precision.hardware import PROC_CPUINFO, probe_hardware

    cpu_flags = probe_hardware(PROC_CPUINFO).cpu_flags  # The machine's, whatever `auto` reads.
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(command),
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in cpu_flags],
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what Python's platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def jax_machine() -> dict[str, Any]:
    """The CPU, its cores, JAX's devices, and the JAX and Keras versions (JAX scripts)."""
    import jax
    import keras

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "devices": [f"/device:{d.platform.upper()}:{d.id} {d.device_kind}" for d in jax.devices()],
        "jax": jax.__version__,
        "keras": keras.__version__,
    }


def device_result_path(output: str, name: str, device_kind: str, today: datetime.date) -> str:
    """`<output>/<name>_<date>_<device>.json`, the device's name in lower case with dashes."""
    device = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"
    return os.path.join(output, f"{name}_{today.isoformat()}_{device}.json")


def stamp(path: str, command: Sequence[str]) -> None:
    """Adds the `run` record of `command` to the JSON result written at `path`."""
    result = read(path)
    result["run"] = record(command)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(result, file, indent=2)


def read(path: str) -> Any | None:
    """The JSON at `path`, or None if there is no such file.

    Raises:
        UserInputError: If it is not JSON.
    """
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise UserInputError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None


def describe(result: Mapping[str, Any], source: str) -> str:
    """The machine and software of `result` in one line, the start of its table's section.

    E.g. `AMD EPYC, 2 cores, CPU flags avx avx2 (no bfloat16 or float16
    arithmetic), TensorFlow 2.21.0, Keras 3.15.1`.

    Raises:
        UserInputError: If `result` (read from `source`) has no `run` record.
    """
    run = run_of(result, source)
    machine = result["machine"]
    flags = " ".join(run["cpu_flags"]) or "none listed"
    if not LOW_PRECISION_CPU_FLAGS.intersection(run["cpu_flags"]):
        flags += " (no bfloat16 or float16 arithmetic)"
    accelerators = [
        device.removeprefix("/device:") for device in machine["devices"] if ":CPU:" not in device
    ]
    return (
        f"{machine['cpu']}, {machine['cpu_count']} cores, CPU flags {flags}, "
        + (f"devices {' '.join(accelerators)}, " if accelerators else "")
        + f"{backend_version(machine)}, Keras {machine['keras']}"
    )


def backend_version(machine: Mapping[str, Any]) -> str:
    """`JAX 0.10.2` or `TensorFlow 2.21.0`: the backend a result's `machine` ran on."""
    if "jax" in machine:
        return f"JAX {machine['jax']}"
    return f"TensorFlow {machine['tensorflow']}"


def one_machine(results: Sequence[Mapping[str, Any]], source: str) -> str:
    """The machine all of `results` were measured on, described.

    Raises:
        UserInputError: If more than one: a table's figures are compared.
    """
    machines = list(dict.fromkeys(describe(result, source) for result in results))
    if len(machines) > 1:
        raise UserInputError(
            f"{source}: measured on {len(machines)} machines: {'; '.join(machines)}. Allowed: "
            "one machine per table (measure every cell there, or start a new results file)"
        )
    return machines[0]


def run_of(result: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `run` record of `result`.

    Raises:
        UserInputError: If it has none.
    """
    if "run" not in result:
        raise UserInputError(
            f"{source}: no 'run' record (date, command, CPU flags). Allowed: a result written "
            "by mpt-bench --output, python -m benchmarks.stack_ablation --add_to or "
            "python -m benchmarks.gpu_check"
        )
    return result["run"]

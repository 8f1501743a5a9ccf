"""Keras dtype policies: choosing the global one and describing a model's.

A precision name is a Keras dtype policy name: `float32`, `mixed_float16` or
`mixed_bfloat16` (`mixed_*` compute in the low-precision type and keep float32
variables). `precision_report` lists what every layer of a built model computes
in, which is what `precision_report.json` in a run's `model_dir` holds.

`resolve_auto_policy` turns precision `auto` into one of those names from what
the hardware computes fast (`probe_hardware`):

    TPU                                       mixed_bfloat16
    GPU, compute capability >= 8.0            mixed_bfloat16  (Ampere and newer)
    GPU, compute capability 7.x               mixed_float16   (Volta, Turing)
    GPU, compute capability < 7.0             float32         (no tensor cores)
    no GPU, CPU flag avx512_bf16 or amx_bf16  mixed_bfloat16
    anything else                             float32

With several GPUs the lowest compute capability decides, since every replica
runs the same policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from mpt_keras.errors import UserInputError
from mpt_keras.layer_paths import iter_layers  # Re-exported: callers import it from here.

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")

# AMX-BF16 CPUs list amx_bf16 next to amx_tile; amx_tile alone (AMX-INT8 only)
# has no bfloat16 arithmetic.
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def check_policy_name(name: str, source: str = "precision") -> str:
    """Returns `name` if it is a supported policy name.

    Raises:
        UserInputError: Naming `source` and the allowed names otherwise.
    """
    if name not in POLICY_NAMES:
        raise UserInputError(
            f"{source}: unknown policy '{name}'. Allowed: {', '.join(POLICY_NAMES)}"
        )
    return name


@contextlib.contextmanager
def global_policy(name: str) -> Iterator[keras.DTypePolicy]:
    """Sets the global Keras dtype policy for the duration of a `with` block.

    Layers created inside the block take the policy by default; the previous
    global policy is restored on exit, even on error.

    Example:

        with global_policy("mixed_bfloat16"):
            model = keras.Sequential([keras.layers.Dense(4)])
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(check_policy_name(name))
    try:
        yield keras.config.dtype_policy()
    finally:
        keras.config.set_dtype_policy(previous)


def precision_report(model: keras.Model) -> dict[str, Any]:
    """Describes the precision of every layer of `model`, nested ones included.

    Args:
        model: A built model.

    Returns:
        `{"model": name, "layers": [...]}` where each layer entry holds `path`
        (`layer_paths.iter_layers`: the layer names from the model down,
        joined by "/"; a softmax or dropout a layer made for itself is named
        by its attribute, `.../self_attention/_softmax`), `class`,
        `policy` (for a layer holding a `DTypePolicyMap`, as after
        `PrecisionManifest.apply` or loading, the policy the map gives it),
        `compute_dtype` and `variable_dtype`, in depth-first order;
        and `"trainable_variables"`: how many trainable variables have each
        dtype (the master weights: all float32 under a `mixed_*` policy).
    """
    layers = [
        {
            "path": path,
            "class": type(layer).__name__,
            "policy": _effective_policy(layer).name,
            "compute_dtype": layer.compute_dtype,
            "variable_dtype": layer.variable_dtype,
        }
        for path, layer in iter_layers(model)
    ]
    variable_dtypes: dict[str, int] = {}
    for variable in model.trainable_variables:
        variable_dtypes[variable.dtype] = variable_dtypes.get(variable.dtype, 0) + 1
    return {"model": model.name, "layers": layers, "trainable_variables": variable_dtypes}


def _effective_policy(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The policy `layer` computes with, looked up in its `DTypePolicyMap` if any.

    Keras looks a layer's path up in the map; a layer without a path (one
    without weights, nested in another) uses the map's default.
    """
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


@dataclasses.dataclass(frozen=True)
class HardwareProbe:
    """What `resolve_auto_policy` needs to know about the machine.

    Attributes:
        cpu_flags: The CPU's feature flags (as in /proc/cpuinfo).
        gpu_compute_capabilities: `(major, minor)` CUDA compute capability of
            each GPU; `(0, 0)` for a GPU that reports none.
        tpu: Whether TPU devices are attached.

    Example:

        policy, reason = resolve_auto_policy(HardwareProbe(gpu_compute_capabilities=((7, 5),)))
        policy  # 'mixed_float16'
        reason  # 'GPU compute capability 7.5: float16 tensor cores, no bfloat16 ones (needs 8.0)'
    """

    cpu_flags: frozenset[str] = frozenset()
    gpu_compute_capabilities: tuple[tuple[int, int], ...] = ()
    tpu: bool = False


def probe_hardware(cpuinfo_path: str = "/proc/cpuinfo") -> HardwareProbe:
    """Probes this machine's CPU flags, GPUs and TPUs.

    Only physical devices are listed, so the TensorFlow runtime is not
    initialised: logical devices (`--virtual_cpus`) can still be configured.

    Args:
        cpuinfo_path: Where the CPU flags are read; a missing file (not Linux)
            means no flags.
    """
    return HardwareProbe(
        cpu_flags=_read_cpu_flags(cpuinfo_path),
        gpu_compute_capabilities=tuple(
            tuple(tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0)))
            for gpu in tf.config.list_physical_devices("GPU")
        ),
        tpu=bool(tf.config.list_physical_devices("TPU")),
    )


def _read_cpu_flags(cpuinfo_path: str) -> frozenset[str]:
    try:
        with open(cpuinfo_path, encoding="utf-8") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_bfloat16_flags(probe: HardwareProbe) -> list[str]:
    """The probed CPU's flags of bfloat16 arithmetic (of `BFLOAT16_CPU_FLAGS`); empty if none."""
    return [flag for flag in BFLOAT16_CPU_FLAGS if flag in probe.cpu_flags]


def resolve_auto_policy(probe: HardwareProbe | None = None) -> tuple[str, str]:
    """Chooses the policy for precision `auto`; see the module docstring.

    Args:
        probe: The hardware to decide for; `None` probes this machine.

    Returns:
        `(policy name, reason)`, the reason a one-line explanation for logs and
        reports.
    """
    probe = probe_hardware() if probe is None else probe
    if probe.tpu:
        return "mixed_bfloat16", "TPU: bfloat16 is the native type of its matrix units"
    if probe.gpu_compute_capabilities:
        major, minor = min(probe.gpu_compute_capabilities)
        gpu = f"GPU compute capability {major}.{minor}"
        if major >= 8:
            return "mixed_bfloat16", f"{gpu}: bfloat16 tensor cores"
        if major == 7:
            return "mixed_float16", f"{gpu}: float16 tensor cores, no bfloat16 ones (needs 8.0)"
        return "float32", f"{gpu}: no tensor cores (needs 7.0)"
    flags = cpu_bfloat16_flags(probe)
    if flags:
        return "mixed_bfloat16", f"no GPU or TPU; CPU computes bfloat16 ({', '.join(flags)})"
    return "float32", (
        "no GPU or TPU, and the CPU lacks bfloat16 instructions "
        f"({' or '.join(BFLOAT16_CPU_FLAGS)})"
    )

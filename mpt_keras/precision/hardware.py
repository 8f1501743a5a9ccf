"""Precision `auto`: the policy this machine's hardware computes fastest in.

`resolve_auto_policy`, from `probe_hardware`:

    TPU                                   mixed_bfloat16
    GPU compute capability >= 8.0         mixed_bfloat16 (Ampere on)
    GPU compute capability 7.x            mixed_float16 (Volta, Turing)
    GPU compute capability < 7.0          float32 (no tensor cores)
    CPU flag avx512_bf16 or amx_bf16      mixed_bfloat16
    else                                  float32

With several GPUs the lowest compute capability decides: every replica runs one policy.
`float8_gemm_support` says, by the same probe, whether float8 GEMMs can run in float8 at all.

The CPU's flags come from `/proc/cpuinfo`, or from the file `MPT_KERAS_CPUINFO` names: a
process (and its children) then decides `auto`, and `jit_compile=auto`, as on that CPU. The
test suite names one, so that no test's path depends on the CPU it runs on.
"""

from __future__ import annotations

import dataclasses
import os

from mpt_keras.backend import current
from mpt_keras.checks import refusal

# This machine's CPU, as Linux describes it; `CPUINFO_ENV` names another's.
PROC_CPUINFO = "/proc/cpuinfo"
CPUINFO_ENV = "MPT_KERAS_CPUINFO"

# amx_tile alone (AMX-INT8) has no bfloat16 arithmetic; AMX-BF16 CPUs list amx_bf16.
BFLOAT16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# Ada's: the first GPUs with float8 tensor cores.
FLOAT8_COMPUTE_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class HardwareProbe:
    """What `resolve_auto_policy` needs: the CPU's flags (as in /proc/cpuinfo), each GPU's
    compute capability `(major, minor)` (`(0, 0)` if unreported), whether TPUs are attached."""

    cpu_flags: frozenset[str] = frozenset()
    gpu_compute_capabilities: tuple[tuple[int, int], ...] = ()
    tpu: bool = False


def probe_hardware(cpuinfo_path: str | None = None) -> HardwareProbe:
    """Probes this machine's CPU flags (none if the file is missing), GPUs and TPUs.

    `cpuinfo_path=None` reads the file `MPT_KERAS_CPUINFO` names (`UserInputError` if there is
    none), else `/proc/cpuinfo`. On TensorFlow it lists physical devices only, so the runtime
    stays uninitialised and logical devices (`--virtual_cpus`) can still be configured; on
    JAX, `jax.devices()`.
    """
    if cpuinfo_path is None:
        cpuinfo_path = os.environ.get(CPUINFO_ENV) or PROC_CPUINFO
        if cpuinfo_path != PROC_CPUINFO and not os.path.isfile(cpuinfo_path):
            raise refusal(
                CPUINFO_ENV, repr(cpuinfo_path), "a file in /proc/cpuinfo's format, or unset"
            )
    if current.is_jax():
        from mpt_keras.backend.jax.devices import accelerators
    else:
        from mpt_keras.backend.tensorflow.devices import accelerators
    capabilities, tpu = accelerators()
    return HardwareProbe(
        cpu_flags=_read_cpu_flags(cpuinfo_path),
        gpu_compute_capabilities=capabilities,
        tpu=tpu,
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
    """`(policy name, one-line reason)` for precision `auto`; `probe=None` probes this machine."""
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


def float8_gemm_support(probe: HardwareProbe, xla: bool = True) -> tuple[bool, str]:
    """`(whether float8 GEMMs can run in float8, one-line reason)`: only XLA's GEMM rewrite on
    GPUs that all (every replica runs one step) have float8 tensor cores reaches them.

    Example:

        float8_gemm_support(HardwareProbe(gpu_compute_capabilities=((9, 0),)))
        # (True, 'GPU compute capability 9.0 and XLA: float8 tensor cores')
    """
    capabilities = probe.gpu_compute_capabilities
    if not capabilities:
        if probe.tpu:
            return False, "TPU: its float8 support is not probed, so counted as emulated"
        return False, "no GPU: this machine has no float8 matmul units"
    major, minor = min(capabilities)
    gpu = f"GPU compute capability {major}.{minor}"
    needed = ".".join(map(str, FLOAT8_COMPUTE_CAPABILITY))
    if (major, minor) < FLOAT8_COMPUTE_CAPABILITY:
        return False, f"{gpu}: no float8 tensor cores (needs {needed})"
    if not xla:
        return False, (
            f"{gpu} has float8 tensor cores, but only XLA's GEMM rewrite reaches them and XLA "
            "is off"
        )
    return True, f"{gpu} and XLA: float8 tensor cores"

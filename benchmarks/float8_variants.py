"""The float8 variants of `mpt-bench`: which layers train in float8, and whether it is emulated.

A float8 twin (`<model>/<precision>+float8/...`) turns every `Dense` and
`EinsumDense` of its model (`to_float8`, after the stack's manifest, before the
optimizer is built). Keras' float8 layers cast a matmul's operands to float8
and back around a matmul in the compute dtype; only XLA's GEMM rewrite on GPUs
of CUDA compute capability 8.9 or newer makes that one float8 matmul. Anywhere
else float8 is `emulated`: extra casts, slower than its twin. A TPU's float8
support is not probed: emulated.
"""

from __future__ import annotations

import keras

from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.precision.float8 import FLOAT8_LAYER_CLASSES
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.names import LOW_PRECISION_POLICIES

EMULATED = "emulated"
NATIVE = "native"
PRECISIONS = LOW_PRECISION_POLICIES  # Those that get a float8 twin.
FLOAT8_COMPUTE_CAPABILITY = (8, 9)  # Ada's: the first GPUs with float8 tensor cores.
METHOD = (
    "a float8 variant: its twin's model with every Dense and EinsumDense layer turned by "
    "mpt_keras.precision.float8.to_float8 after the stack's manifest, before the optimizer is "
    "built; speed.vs_no_float8: its examples/s over the twin's; float8.execution: native only "
    "with XLA on GPUs of compute capability 8.9 or newer, else emulated"
)
_EMULATION = (
    "Keras' float8 layers cast their matmuls' operands to float8 and back and multiply "
    "in the compute dtype: extra work, no speed-up"
)


def float8_paths(model: keras.Model) -> tuple[str, ...]:
    """The paths of every `Dense` and `EinsumDense` of `model` (Keras' own classes:
    `to_float8` takes no subclass)."""
    return tuple(
        entry.path for entry in iter_layer_paths(model) if type(entry.layer) in FLOAT8_LAYER_CLASSES
    )


def execution(probe: HardwareProbe, xla: bool) -> tuple[str, str]:
    """`(NATIVE or EMULATED, reason)`: native only with XLA on GPUs that all (every
    replica runs the same step) have float8 tensor cores.

    Example:

        execution(HardwareProbe(gpu_compute_capabilities=((9, 0),)), xla=True)
        # ('native', 'GPU compute capability 9.0 and XLA: float8 tensor cores')
    """
    capabilities = probe.gpu_compute_capabilities
    if not capabilities:
        if probe.tpu:
            return EMULATED, "TPU: its float8 support is not probed, so counted as emulated"
        return EMULATED, f"no GPU: this machine has no float8 matmul units; {_EMULATION}"
    major, minor = min(capabilities)
    gpu = f"GPU compute capability {major}.{minor}"
    needed = ".".join(map(str, FLOAT8_COMPUTE_CAPABILITY))
    if (major, minor) < FLOAT8_COMPUTE_CAPABILITY:
        return EMULATED, f"{gpu}: no float8 tensor cores (needs {needed}); {_EMULATION}"
    if not xla:
        return EMULATED, (
            f"{gpu} has float8 tensor cores, but only XLA's GEMM rewrite reaches them and XLA "
            f"is off; {_EMULATION}"
        )
    return NATIVE, f"{gpu} and XLA: float8 tensor cores"

"""The float8 variants of `mpt-bench`: which layers train in float8, and whether it is emulated.

With `--float8`, each `mixed_float16` and `mixed_bfloat16` variant of a model
gets a twin, `<model>/<precision>+float8/...`, whose `Dense` and `EinsumDense`
layers (Keras' own classes, every one of the model, the output layer
included) train their matmuls in float8: `mpt_keras.precision.float8.
to_float8`, after the stack's manifest and before the optimizer is built.
The rest of the model computes as in its twin.

Keras' float8 layers quantize a matmul's operands (and its output gradient)
to float8 and back, by casts, around a matmul in the compute dtype. Only
XLA's GEMM rewrite on a GPU with float8 tensor cores (CUDA compute
capability 8.9 or newer: Ada, Hopper and later) turns that into one float8
matmul. Anywhere else (a CPU, an older GPU, or XLA off) the casts are extra
work around the same matmul: float8 is `emulated`, and slower than the twin
without it. Each float8 variant is labelled so; a TPU's float8 support is not
probed, and counts as emulated.

Example:

    execution(HardwareProbe(), xla=True)
    # ('emulated', 'no GPU: this machine has no float8 matmul units, ...')
    execution(HardwareProbe(gpu_compute_capabilities=((9, 0),)), xla=True)
    # ('native', 'GPU compute capability 9.0 and XLA: float8 tensor cores')
"""

from __future__ import annotations

import keras

from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.precision.float8 import FLOAT8_LAYER_CLASSES
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.names import LOW_PRECISION_POLICIES

EMULATED = "emulated"
NATIVE = "native"
# The precisions that get a float8 twin.
PRECISIONS = LOW_PRECISION_POLICIES
# CUDA compute capability of the first GPUs with float8 tensor cores (Ada).
FLOAT8_COMPUTE_CAPABILITY = (8, 9)
_EMULATION = (
    "Keras' float8 layers cast their matmuls' operands to float8 and back and multiply "
    "in the compute dtype: extra work, no speed-up"
)


def float8_paths(model: keras.Model) -> tuple[str, ...]:
    """The paths of the layers of `model` a float8 variant turns to float8: every `Dense`
    and `EinsumDense` (Keras' own classes: `to_float8` takes no subclass)."""
    return tuple(
        entry.path for entry in iter_layer_paths(model) if type(entry.layer) in FLOAT8_LAYER_CLASSES
    )


def execution(probe: HardwareProbe, xla: bool) -> tuple[str, str]:
    """Whether float8 matmuls run on float8 units here, with or without XLA.

    Args:
        probe: The machine (`mpt_keras.precision.hardware.probe_hardware()`).
        xla: Whether the train step is compiled with XLA.

    Returns:
        `(NATIVE or EMULATED, reason)`: native only with XLA, on GPUs that all
        have float8 tensor cores (every replica runs the same step); a TPU
        counts as emulated, as this probe knows no TPU's float8 support.
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

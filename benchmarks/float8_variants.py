"""The float8 variants of `mpt-bench`: which layers train in float8, and whether it is emulated.

A float8 twin (`<model>/<precision>+float8/...`) turns every `Dense` and
`EinsumDense` of its model (`to_float8`, after the stack's manifest, before the
optimizer is built), which runs their three GEMMs on operands quantized to
float8 (`precision/float8_gemms.py`); only XLA on GPUs of CUDA compute capability
8.9 or newer makes each one float8 matmul. Anywhere else float8 is `emulated`:
extra casts, slower than its twin. A TPU's float8
support is not probed: emulated.
"""

from __future__ import annotations

import keras

from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.precision.float8 import FLOAT8_LAYER_CLASSES
from mpt_keras.precision.hardware import HardwareProbe, float8_gemm_support
from mpt_keras.precision.names import LOW_PRECISION_POLICIES

EMULATED = "emulated"
NATIVE = "native"
# A float8 GPU's execution by the census of the compiled step (`Float8Census.state`).
CENSUS_EXECUTION = {
    "float8": NATIVE,
    "partly float8": "partly native",
    "fallback": "fallback",
    "emulated": EMULATED,
}
PRECISIONS = LOW_PRECISION_POLICIES  # Those that get a float8 twin.
METHOD = (
    "a float8 variant: its twin's model with every Dense and EinsumDense layer turned by "
    "mpt_keras.precision.float8.to_float8 after the stack's manifest, before the optimizer is "
    "built; speed.vs_no_float8: its examples/s over the twin's; float8.execution: native only "
    "with XLA on GPUs of compute capability 8.9 or newer and every float8 GEMM of the compiled "
    "step in float8 (float8.census), partly native or fallback where some or none is, else "
    "emulated"
)
_EMULATION = (
    "float8 layers quantize their matmuls' operands to float8 and multiply them converted "
    "back to a wider type: extra work, no speed-up"
)


def float8_paths(model: keras.Model) -> tuple[str, ...]:
    """The paths of every `Dense` and `EinsumDense` of `model` (Keras' own classes:
    `to_float8` takes no subclass)."""
    return tuple(
        entry.path for entry in iter_layer_paths(model) if type(entry.layer) in FLOAT8_LAYER_CLASSES
    )


def execution(probe: HardwareProbe, xla: bool) -> tuple[str, str]:
    """`(NATIVE or EMULATED, reason)`: native only where `float8_gemm_support` says float8
    GEMMs can run (the census of the compiled step says which do).

    Example:

        execution(HardwareProbe(gpu_compute_capabilities=((9, 0),)), xla=True)
        # ('native', 'GPU compute capability 9.0 and XLA: float8 tensor cores')
    """
    supported, reason = float8_gemm_support(probe, xla)
    return (NATIVE, reason) if supported else (EMULATED, f"{reason}; {_EMULATION}")

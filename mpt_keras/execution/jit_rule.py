"""The `jit_compile` rule: whether XLA compiles the train step, for `auto` by device and model.

`auto`: XLA on for TPU and GPU replicas. On CPU replicas, as `mpt-bench` measured (ratios in
docs/distribution.md): on for attention models (XLA fuses around the matmuls), except in
mixed_bfloat16 above `XLA_BFLOAT16_MAX_PARAMETERS` where oneDNN's bfloat16 matmuls win; on for
convolutions in mixed_float16 (oneDNN has no float16), and in mixed_bfloat16 where the CPU
has no bfloat16 instructions (emulated); off for the rest (an XLA call costs ~5 ms a step).
Under `deterministic`, XLA has no MaxPool gradient.

Examples/s with XLA over without, a 2-block Transformer in mixed_bfloat16 with AVX512_BF16
on 2 EPYC cores: 1.18 at 0.14M parameters, 1.04 at 0.47M, 0.73 at 1.73M, 0.60 at 6.60M.
"""

from __future__ import annotations

from typing import Any

import keras

from mpt_keras.backend.tensorflow.devices import replica_device_type
from mpt_keras.checks import check_choice
from mpt_keras.config import JIT_COMPILE
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.hardware import cpu_bfloat16_flags, probe_hardware
from mpt_keras.precision.names import check_policy_name

# The measured crossover of bfloat16 attention models on CPUs: 0.47M-1.73M.
XLA_BFLOAT16_MAX_PARAMETERS = 1_000_000
_CONVOLUTIONS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
# "GPU MaxPool gradient ops do not yet have a deterministic XLA implementation",
# on every device type.
_NO_DETERMINISTIC_XLA_GRADIENT = {
    keras.layers.MaxPooling1D: "MaxPool",
    keras.layers.MaxPooling2D: "MaxPool",
    keras.layers.MaxPooling3D: "MaxPool",
}


def resolve_jit_compile(
    setting: str,
    strategy: Any,  # A tf.distribute.Strategy.
    precision: str,
    model: keras.Model | None = None,
    *,
    deterministic: bool = False,
) -> tuple[bool, str]:
    """`(jit_compile, reason)`: whether XLA compiles the train step, and why in one line.

    `model=None` counts as one without attention; `deterministic`: the run enables op
    determinism. Raises `UserInputError` for an unknown setting or precision, or `true` with
    `deterministic` on a model XLA cannot step deterministically.
    """
    check_choice("jit_compile", setting, JIT_COMPILE)
    check_policy_name(precision)
    blocker = _no_deterministic_xla_gradient(model) if deterministic else None
    if setting == "true" and blocker:
        raise UserInputError(
            f"jit_compile=true with deterministic: XLA has no deterministic {blocker}. Use "
            "jit_compile=false or auto (XLA off for this model), or train without deterministic"
        )
    if setting != "auto":
        return setting == "true", f"jit_compile={setting}: as set"
    if blocker:
        return False, f"jit_compile=auto, deterministic: XLA off, it has no deterministic {blocker}"
    device_type = replica_device_type(strategy)
    prefix = f"jit_compile=auto: {device_type} replicas, {precision}: XLA"
    if device_type != "CPU":
        return True, f"{prefix} on, the fast path on accelerators"
    emulated_bfloat16 = precision == "mixed_bfloat16" and not cpu_bfloat16_flags(probe_hardware())
    if model is not None and _has_attention(model):
        parameters = model.count_params()
        if (
            precision == "mixed_bfloat16"
            and not emulated_bfloat16
            and parameters > XLA_BFLOAT16_MAX_PARAMETERS
        ):
            return False, (
                f"{prefix} off, an attention model of {parameters:,} parameters (over "
                f"{XLA_BFLOAT16_MAX_PARAMETERS:,}): oneDNN's bfloat16 matmuls are faster"
            )
        return True, f"{prefix} on, the model has attention layers (XLA fuses around them)"
    if model is not None and _has_convolution(model):
        if precision == "mixed_float16":
            return True, (
                f"{prefix} on, float16 convolutions: XLA's beat TensorFlow's Eigen fallback "
                "(no oneDNN float16 here)"
            )
        if emulated_bfloat16:
            return True, (
                f"{prefix} on, bfloat16 convolutions on a CPU without bfloat16 instructions: "
                "XLA's beat TensorFlow's emulated ones"
            )
    return False, (
        f"{prefix} off, no attention layers: TensorFlow's CPU kernels are as fast or faster"
    )


def _no_deterministic_xla_gradient(model: keras.Model | None) -> str | None:
    """What in `model` XLA cannot differentiate deterministically, e.g. "MaxPool gradient
    (layer 'pool_1', MaxPooling2D)"; None if nothing."""
    for path, layer in iter_layers(model) if model is not None else ():
        for layer_type, op in _NO_DETERMINISTIC_XLA_GRADIENT.items():
            if isinstance(layer, layer_type):
                return f"{op} gradient (layer '{path}', {type(layer).__name__})"
    return None


def _has_attention(model: keras.Model) -> bool:
    return any(
        isinstance(layer, keras.layers.MultiHeadAttention) or "Attention" in type(layer).__name__
        for _, layer in iter_layers(model)
    )


def _has_convolution(model: keras.Model) -> bool:
    return any(isinstance(layer, _CONVOLUTIONS) for _, layer in iter_layers(model))

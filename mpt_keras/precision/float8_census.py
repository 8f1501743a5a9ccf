"""The float8 census: what each float8 layer's GEMMs really run in, read from the compiled step.

`to_float8` makes a layer quantize its matmul's operands to float8; only XLA, on a device
with float8 tensor cores, turns a GEMM of them into a float8 GEMM, and it decides per GEMM
(Keras' own form of the three loses all of them on an H100; then they run in bfloat16 or
float32, with the quantization's cost on top). So the census compiles the train step, never
runs it, and reads each GEMM of each float8 layer from the optimized program
(`compiled_gemms`). A GEMM is `float8`, a `fallback` (float8 GEMMs exist on this device, yet
this one runs wider: logged as a warning) or `emulated` (the device has none).

Each float8 layer's call runs in a name scope of its own for the compile, so its GEMMs, the
gradients' too, carry it in their `op_name`.

Example:

    census = take_census(model, (x, y))  # Float8 layers, compiled with jit_compile=True.
    print(census.format_table())
    census.summary()  # 'emulated: 0 of 5 GEMMs of 2 float8 layers run in float8 (no GPU: ...)'
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.checks import refusal
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.precision.compiled_gemms import CompiledGemm, compiled_gemms
from mpt_keras.precision.float8 import is_float8
from mpt_keras.precision.float8_gemms import GEMM_SCOPES
from mpt_keras.precision.hardware import HardwareProbe, float8_gemm_support, probe_hardware
from mpt_keras.tables import aligned

_LOGGER = logging.getLogger(__name__)
# The name scope each float8 layer's call runs in for the census; TensorFlow may add `_<n>`.
_SCOPE = "mpt_float8_census_"
_SCOPE_IN_OP_NAME = re.compile(rf"(?:^|[/(]){_SCOPE}(\d+)(?:_\d+)?(?=[/)]|$)")
VERDICTS = ("float8", "fallback", "emulated")
_ROLES = ("forward", "input gradient", "weight gradient", "gradient")
# Our GEMMs' name scopes (TensorFlow may add `_<n>`), each read as the role it names.
_ROLE_OF_SCOPE = {scope: role for scope, role, _ in GEMM_SCOPES.values()}
_GEMM_SCOPE = re.compile(rf"(?:^|[/(])({'|'.join(_ROLE_OF_SCOPE)})(?:_\d+)?(?=[/)]|$)")


@dataclasses.dataclass(frozen=True)
class GemmCensus:
    """One GEMM of a float8 layer: `gemm` is `forward`, `input gradient`, `weight gradient`
    (or `gradient` where the two cannot be told apart), `runs_in` its operands' precision,
    `kernel` what XLA made of it (`dot`, `__cublas$lt$matmul$f8`, ...), `verdict` one of
    `VERDICTS`."""

    layer: str
    gemm: str
    runs_in: str
    kernel: str
    verdict: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Float8Census:
    """The census of a compiled train step. `float8_gemms`: whether this device can run float8
    GEMMs at all (`reason` says why); `unseen`: float8 layers none of whose GEMMs was found."""

    float8_gemms: bool
    reason: str
    rows: tuple[GemmCensus, ...]
    unseen: tuple[str, ...] = ()

    @property
    def fallbacks(self) -> tuple[GemmCensus, ...]:
        return tuple(row for row in self.rows if row.verdict == "fallback")

    @property
    def state(self) -> str:
        """`float8` (every GEMM found runs in float8), `partly float8`, `fallback` (none does,
        on a device that could) or `emulated` (the device has no float8 GEMMs)."""
        in_float8 = sum(row.verdict == "float8" for row in self.rows)
        if not self.float8_gemms:
            return "emulated"
        if not in_float8:
            return "fallback"
        return "partly float8" if self.fallbacks or self.unseen else "float8"

    def summary(self) -> str:
        """One line: the state, how many GEMMs run in float8, how many float8 layers had none
        found (so that "0 of 0" is never read as a verdict), and the device's reason."""
        layers = len({row.layer for row in self.rows} | set(self.unseen))
        in_float8 = sum(row.verdict == "float8" for row in self.rows)
        unseen = f"; no GEMM found for {len(self.unseen)} of the layers" if self.unseen else ""
        return (
            f"{self.state}: {in_float8} of {len(self.rows)} GEMMs of {layers} float8 "
            f"layer{'s' * (layers != 1)} run in float8{unseen} ({self.reason})"
        )

    def format_table(self) -> str:
        """The GEMMs as an aligned table under the summary line."""
        rows = [("layer", "gemm", "runs_in", "kernel", "verdict")]
        rows += [(r.layer, r.gemm, r.runs_in, r.kernel, r.verdict) for r in self.rows]
        rows += [(path, "(none found)", "", "", "") for path in self.unseen]
        return "\n".join([f"float8 census, {self.summary()}", *aligned(rows)]) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "float8_gemms": self.float8_gemms,
            "reason": self.reason,
            "state": self.state,
            "summary": self.summary(),
            "gemms": [row.to_dict() for row in self.rows],
            "unseen": list(self.unseen),
        }


def take_census(
    model: keras.Model,
    batch: Any,
    *,
    probe: HardwareProbe | None = None,
    xla: bool | None = None,
    target: str | None = None,
) -> Float8Census:
    """The census of `model`'s train step on `batch` (one batch as `fit` takes it).

    `model` is compiled (its loss and optimizer set); its float8 layers are found by
    `is_float8`. `probe`: this machine's by default. `xla`: whether the step runs under XLA;
    by default as `fit` runs it (`model.jit_compile`: on TensorFlow, Keras' `auto` is off on a
    CPU), so the census never reads a program the model does not run. With XLA off nothing
    is compiled: without XLA no float8 GEMM exists, every float8 layer is `emulated`.
    `target` (JAX only; `backend.names.GPU_TARGETS`, such as `h100`): the step compiled for
    that GPU instead, on this machine, whatever it has (`backend/jax/gpu_targets.py`: what it
    needs, what differs).
    """
    if target is not None:
        _check_census_target(target)  # A bad target is the error, before the model is read.
    if xla is None:  # As `fit` runs the step (an uncompiled model is refused below).
        xla = bool(model.jit_compile) if model.compiled else True
    if target is not None:
        supported, reason = _target_float8_support(target, xla)
    else:
        supported, reason = float8_gemm_support(probe or probe_hardware(), xla)
    layers: dict[str, Any] = {}
    for entry in iter_layer_paths(model):
        if is_float8(entry.layer) and all(entry.layer is not seen for seen in layers.values()):
            layers[entry.path] = entry.layer  # A shared layer once, at its first path.
    if not xla or not layers:
        return Float8Census(supported, reason, rows=(), unseen=tuple(layers))
    if not model.compiled:
        raise refusal(
            "float8 census",
            f"model '{model.name}', which is not compiled (no train step to compile)",
            "a model compiled with its optimizer and loss (model.compile)",
        )
    _check_census_batch(model, batch)
    compat.symbolic_build(model, batch)
    indices = {id(layer): index for index, layer in enumerate(layers.values())}
    with calls_wrapped(layers.values(), functools.partial(_in_scope, indices)):
        if current.is_jax():
            from mpt_keras.backend.jax.compiled import train_step_hlo
        else:
            from mpt_keras.backend.tensorflow.compiled import train_step_hlo
        hlo = train_step_hlo(model, batch, target) if target else train_step_hlo(model, batch)
    kernel_sizes = {path: math.prod(layer.kernel.shape) for path, layer in layers.items()}
    census = census_of(compiled_gemms(hlo), kernel_sizes, supported, reason)
    for row in census.fallbacks:
        _LOGGER.warning(
            "Float8 layer %s: its %s GEMM runs in %s, not float8 (%s): it pays the quantization "
            "and gains nothing.",
            row.layer,
            row.gemm,
            row.runs_in,
            row.kernel,
        )
    return census


def _check_census_target(target: str) -> None:
    """A one-line error off JAX, or for a GPU target JAX is not told of."""
    if not current.is_jax():
        raise UserInputError(
            f"float8 census for GPU target '{target}': received Keras backend "
            f"'{current.name()}'. Allowed: jax (JAX's CUDA plugin compiles for a GPU without one)"
        )
    from mpt_keras.backend.jax import gpu_targets

    gpu_targets.check_target(target)


def _check_census_batch(model: keras.Model, batch: Any) -> None:
    """Inputs alone, for a model compiled with a loss, are refused here: Keras' loss would
    fail deep in the compile (on JAX: `None is not a valid value for jnp.array`)."""
    if keras.utils.unpack_x_y_sample_weight(batch)[1] is None and model.loss is not None:
        raise refusal(
            "float8 census batch",
            f"inputs alone, no targets, for model '{model.name}' compiled with a loss",
            "(x, y) or (x, y, sample_weight), one batch as fit takes it",
        )


def _target_float8_support(target: str, xla: bool) -> tuple[bool, str]:
    """`float8_gemm_support` of the GPU `target` (checked: `_check_census_target`), compiled
    for here."""
    from mpt_keras.backend.jax import gpu_targets

    probe = HardwareProbe(gpu_compute_capabilities=(gpu_targets.COMPUTE_CAPABILITY,))
    supported, reason = float8_gemm_support(probe, xla)
    if not xla:
        return supported, f"{target}, not compiled: {reason}"
    return supported, f"compiled for {target}, no autotuning: {reason}"


def census_of(
    gemms: tuple[CompiledGemm, ...],
    kernel_sizes: Mapping[str, int],
    float8_gemms: bool,
    reason: str,
) -> Float8Census:
    """The census from a program's GEMMs, each float8 layer's found by its scope's index (the
    order of `kernel_sizes`: layer path -> its kernel's element count)."""
    paths = list(kernel_sizes)
    by_layer: dict[str, list[CompiledGemm]] = {path: [] for path in paths}
    for gemm in gemms:
        match = _SCOPE_IN_OP_NAME.search(gemm.op_name)
        if match and int(match.group(1)) < len(paths):
            by_layer[paths[int(match.group(1))]].append(gemm)
    rows = []
    for path, found in by_layer.items():
        roles = _roles(found, kernel_sizes[path])
        for role, gemm in sorted(zip(roles, found), key=lambda pair: _ROLES.index(pair[0])):
            if gemm.precision == "float8":
                verdict = "float8"
            else:
                verdict = "fallback" if float8_gemms else "emulated"
            rows.append(GemmCensus(path, role, gemm.precision, gemm.kernel, verdict))
    unseen = tuple(path for path, found in by_layer.items() if not found)
    return Float8Census(float8_gemms, reason, tuple(rows), unseen)


def _roles(gemms: list[CompiledGemm], kernel_size: int) -> list[str]:
    """Each GEMM's role: the name scope ours run in says it (`float8_gemms.GEMM_SCOPES`).
    Keras' own: forward unless it is a gradient's (JAX: in a `transpose(`; TF: under a
    `gradient_tape/` scope). TensorFlow marks which operand's gradient (`grad_x`: the
    inputs'); on JAX the weight gradient is the one whose result has the kernel's size (where
    none has, a split-K one's last two dimensions), unless every gradient GEMM's has (tokens
    equal to the output width): then `gradient`."""
    scoped = [_GEMM_SCOPE.search(gemm.op_name) for gemm in gemms]
    if all(scoped):
        return [_ROLE_OF_SCOPE[match.group(1)] for match in scoped]
    backward = [
        "transpose(" in gemm.op_name
        or "gradient_tape/" in gemm.op_name
        or gemm.gradient_of is not None
        for gemm in gemms
    ]
    kernel_sized = [
        is_backward and gemm.result_size == kernel_size
        for gemm, is_backward in zip(gemms, backward)
    ]
    if not any(kernel_sized):  # A GPU's split-K GEMM: `[splits, K, N]` partial sums.
        kernel_sized = [
            is_backward and math.prod(gemm.result_shape[-2:]) == kernel_size
            for gemm, is_backward in zip(gemms, backward)
        ]
    ambiguous = sum(kernel_sized) > 1 and all(kernel_sized[i] for i, b in enumerate(backward) if b)
    roles = []
    for gemm, is_backward, sized in zip(gemms, backward, kernel_sized):
        if not is_backward:
            roles.append("forward")
        elif gemm.gradient_of is not None:
            roles.append("input gradient" if gemm.gradient_of == "x" else "weight gradient")
        elif ambiguous:
            roles.append("gradient")
        else:
            roles.append("weight gradient" if sized else "input gradient")
    return roles


def _in_scope(indices: Mapping[int, int], layer: keras.layers.Layer, call: Any) -> Any:
    """`call` run in the census's name scope of `layer`."""

    @functools.wraps(call)
    def scoped_call(*args: Any, **kwargs: Any) -> Any:
        with keras.name_scope(f"{_SCOPE}{indices[id(layer)]}"):
            return call(*args, **kwargs)

    return scoped_call

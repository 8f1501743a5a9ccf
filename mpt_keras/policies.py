"""Keras dtype policies: choosing the global one and describing a model's.

A precision name is a Keras dtype policy name: `float32`, `mixed_float16` or
`mixed_bfloat16` (`mixed_*` compute in the low-precision type and keep float32
variables). `precision_report` lists what every layer of a built model computes
in, and what it really outputs in one traced forward pass, which is what
`precision_report.json` in a run's `model_dir` holds.

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
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from mpt_keras import keras_compat as compat
from mpt_keras.components import describe_error
from mpt_keras.errors import UserInputError
from mpt_keras.layer_paths import iter_layers  # Re-exported: callers import it from here.

_LOGGER = logging.getLogger(__name__)

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


def precision_report(model: keras.Model, inputs: Any = None) -> dict[str, Any]:
    """Describes the precision of every layer of `model`, nested ones included.

    Each layer's output dtype is what it returned in one forward pass of the
    model traced as the train step calls it (`training=True`, in a
    `tf.function` that never runs: no data, no state changes); each layer's
    `call` is wrapped for the trace and restored after it, even on error. A
    model not built yet, or one the trace fails on (logged as a warning), has
    output dtypes None.

    Args:
        model: A model, built to be traced.
        inputs: What the model is traced on: example inputs (arrays or
            tensors; one example is enough) or their specs (`keras.Input`,
            `tf.TensorSpec`), structured as the model takes them. Default: a
            functional or Sequential model's own inputs; a subclassed model
            has none, so without `inputs` its layers' output dtypes are None.

    Returns:
        `{"model": name, "layers": [...]}` where each layer entry holds `path`
        (`layer_paths.iter_layers`: the layer names from the model down,
        joined by "/"; a softmax or dropout a layer made for itself is named
        by its attribute, `.../self_attention/_softmax`), `class`,
        `policy` (for a layer holding a `DTypePolicyMap`, as after
        `PrecisionManifest.apply` or loading, the policy the map gives it),
        `compute_dtype`, `variable_dtype` and `output_dtype` (see
        `output_dtype_mismatches`; None for a layer the trace did not call, or
        that returned no tensor), in depth-first order;
        `"trainable_variables"`: how many trainable variables have each dtype
        (the master weights: all float32 under a `mixed_*` policy); and
        `"output_dtype_mismatches"`: the paths of the layers that made a
        floating output of another dtype than their compute dtype, their
        `output_dtype` that one (a float32 NumPy constant mixed into a
        bfloat16 input makes float32). Integer outputs, and a tensor a layer
        returns as it was given it or as a sublayer returned it (an attention
        returning its output projection's bfloat16 under a float16 policy),
        are not the layer's mismatch: the sublayer is flagged if it made it.
    """
    returned = _returned_dtypes(model, inputs)
    layers, mismatches = [], []
    for path, layer in iter_layers(model):
        output_dtype, mismatched = _output_dtype(returned.get(id(layer), ()), layer.compute_dtype)
        layers.append(
            {
                "path": path,
                "class": type(layer).__name__,
                "policy": _effective_policy(layer).name,
                "compute_dtype": layer.compute_dtype,
                "variable_dtype": layer.variable_dtype,
                "output_dtype": output_dtype,
            }
        )
        if mismatched:
            mismatches.append(path)
    variable_dtypes: dict[str, int] = {}
    for variable in model.trainable_variables:
        variable_dtypes[variable.dtype] = variable_dtypes.get(variable.dtype, 0) + 1
    return {
        "model": model.name,
        "layers": layers,
        "trainable_variables": variable_dtypes,
        "output_dtype_mismatches": mismatches,
    }


def _output_dtype(
    returned: Sequence[tuple[str, bool]], compute_dtype: str
) -> tuple[str | None, bool]:
    """A layer's output dtype, and whether it made a floating one other than `compute_dtype`.

    Args:
        returned: `(dtype, made by the layer)` of each tensor it returned, in
            every call.
        compute_dtype: The layer's compute dtype.
    """
    if keras.backend.is_float_dtype(compute_dtype):
        for dtype, made in returned:
            if made and keras.backend.is_float_dtype(dtype) and dtype != compute_dtype:
                return dtype, True
    floating = [dtype for dtype, _ in returned if keras.backend.is_float_dtype(dtype)]
    dtypes = floating or [dtype for dtype, _ in returned]
    return (dtypes[0] if dtypes else None), False


def _returned_dtypes(model: keras.Model, inputs: Any) -> dict[int, list[tuple[str, bool]]]:
    """`{id(layer): [(dtype, made by the layer), ...]}` of every tensor each
    layer of `model` returned in one traced forward pass; empty if the model
    is not built or has no inputs to trace it on, or if the trace fails."""
    if inputs is None:
        inputs = _symbolic_inputs(model)
    if not model.built or inputs is None:
        return {}
    specs = keras.tree.map_structure(
        lambda value: tf.TensorSpec(
            tuple(value.shape), keras.backend.standardize_dtype(value.dtype)
        ),
        inputs,
    )
    layers = list({id(layer): layer for _, layer in iter_layers(model)}.values())
    recorder = _CallRecorder()

    @tf.function
    def train_forward(values):
        return model(values, training=True)

    try:
        with (
            recorder.wrapping(layers),
            compat.call_records_restored([model, *layers]),
            keras.StatelessScope(),  # Nothing the trace assigns or adds as a loss is kept.
        ):
            train_forward.get_concrete_function(specs)
    except Exception as error:  # The report still describes the policies.
        # Keras and AutoGraph wrap the error of the layer that failed.
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__
        _LOGGER.warning(
            "Model %s: not traced to find each layer's output dtype (%s)",
            model.name,
            describe_error(error),
        )
        return {}
    return recorder.returned


def _symbolic_inputs(model: keras.Model) -> Any:
    """A functional or Sequential model's inputs, as it takes them; else None."""
    if isinstance(model, keras.Sequential):
        return model.inputs[0] if model.built else None
    return model.input if hasattr(model, "inputs") else None


class _CallRecorder:
    """Wraps the `call` of layers and records the dtypes of the tensors they return.

    A returned tensor is the layer's own (`made`) unless the call was given
    it, or a layer called inside the call returned it.
    """

    def __init__(self):
        self.returned: dict[int, list[tuple[str, bool]]] = {}
        # Per call under way, the tensors it was given or its sublayers
        # returned, by id (held, so that no id is reused during the trace).
        self._not_made: list[dict[int, Any]] = []

    @contextlib.contextmanager
    def wrapping(self, layers: Iterable[keras.layers.Layer]) -> Iterator[None]:
        """Wraps each layer's `call` inside the block; restores them on exit, even on error."""
        wrapped = []
        try:
            for layer in layers:
                own_call = vars(layer).get("call")
                layer.call = self._recording(layer, layer.call)
                wrapped.append((layer, own_call))
            yield
        finally:
            for layer, own_call in wrapped:
                if own_call is None:
                    del layer.call
                else:
                    layer.call = own_call

    def _recording(self, layer: keras.layers.Layer, call: Any) -> Any:
        @functools.wraps(call)
        def recording_call(*args, **kwargs):
            self._not_made.append({id(tensor): tensor for tensor in _tensors((args, kwargs))})
            try:
                outputs = call(*args, **kwargs)
            finally:
                not_made = self._not_made.pop()
            tensors = _tensors(outputs)
            self.returned.setdefault(id(layer), []).extend(
                (keras.backend.standardize_dtype(tensor.dtype), id(tensor) not in not_made)
                for tensor in tensors
            )
            for enclosing in self._not_made:
                enclosing.update((id(tensor), tensor) for tensor in tensors)
            return outputs

        return recording_call


def _tensors(structure: Any) -> list[Any]:
    return [value for value in keras.tree.flatten(structure) if keras.ops.is_tensor(value)]


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

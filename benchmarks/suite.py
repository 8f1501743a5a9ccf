"""The benchmark suite behind `mpt-bench`: every variant side by side, against the machine's limit.

A variant is a model, a precision (`float32`, `mixed_bfloat16`,
`mixed_float16`), XLA (`off`, `on`) and a stack (`benchmarks.stacks`); with
`float8`, each `mixed_float16` and `mixed_bfloat16` variant also has a twin
whose Dense and EinsumDense layers train in float8 (`+float8` after the
precision in its name, `benchmarks.float8_variants`), labelled `emulated`
unless the hardware runs float8 matmuls. The model (`benchmarks.workloads`) is
either

    a reference model   the Transformer LM, the 8x8 CNN or MLP (`models`), on
                        random batches sized by the settings (`batch_size`,
                        `image_batch_size`, `sequence_length`, `num_layers`,
                        `d_model`), trained with `models.REFERENCE_LOSS`
    a run config's      (`config`) whatever model, data and loss it names,
                        assembled as `mpt-train` assembles them
                        (`runs.resolve_components`): a reference model, a
                        `model.factory` or a `model.file`; its data's train
                        batches (`data.batch_size`, `data.shuffle_buffer`,
                        `seed`; the settings' sizes do not apply) and its loss;
                        named by `config_name` (`mpt-bench`: the file's stem).
                        Its precision, manifest, optimizer, metrics, strategy
                        and XLA setting are not used: the variants decide those

and the stacks are

    ours    the global policy, `PrecisionManifest(default=precision)` (the safe
            defaults: normalization and the output layer in float32) applied,
            `mpt_keras.LossScaleOptimizer` (dynamic loss scaling in
            `mixed_float16`, else a fixed scale of 1 that still skips
            non-finite steps, as `mpt-train` makes it), `xla.compile_model` (with
            XLA: the whole step on one device) and a `MixedPrecisionMonitor` at
            its default `update_freq`
    stock   the global policy only, `keras.optimizers.LossScaleOptimizer` for
            `mixed_float16` and the plain optimizer otherwise,
            `model.compile(jit_compile=...)`, no callback

Both stacks train with AdamW(1e-3), without metrics, from the same initial
weights (a reference model is built from seed 0; a config's model once in
float32, its weights then copied into every variant) on the same batches,
with the train-step loop of `model.fit` (`harness.FitLoop`). All
variants are built and warmed up, then timed in ONE process, interleaved
round by round (`harness.interleave`), so machine drift cancels. Before them,
the matmul peak per dtype is measured the same way (`matmul_peak`).

Per variant: the median step time over the rounds, examples (and tokens, for
a model of token sequences) per second, the train step's FLOPs (`flops`,
traced on the batch's input spec, dict inputs included; None where they
cannot be counted, e.g. a dynamic shape) and FLOP/s, their fraction of the
matmul peak of the variant's compute dtype, peak memory, and speed ratios
(examples/s of one variant over another's; above 1: faster), each as the
ratio of the medians and the median of the per-round ratios:
`vs_float32` (same model, XLA and stack in float32, without float8),
`vs_stock` (ours over stock), `vs_no_xla` (XLA on over off) and
`vs_no_float8` (a float8 variant over its twin without float8); a float8
variant's `float8` says whether it is `emulated` or `native`, and why, and
the result's `float8` lists the layers turned, per model. Per (model,
precision): what `resolve_jit_compile("auto", ...)` chooses and its step time
over the better of XLA on and off.

Memory is read from TensorFlow's allocator statistics of the device
(`tf.config.experimental.get_memory_info`, reset before each variant's
reading), one variant at a time right after its first step, over
`memory_steps` train steps without callbacks (the monitor resets those
statistics at its writes), for a config's model as for a reference model:
`peak_memory_bytes` is the peak minus what was allocated before the variant
was built, its dataset made but not yet read (what it keeps, weights,
optimizer state and input buffers, plus a step's working memory; not the
data's arrays), `step_memory_bytes` the peak minus what was allocated when
the steps began (activations, gradients, temporaries). On CPU, TensorFlow
2.21 keeps these statistics with its BFC allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true`, which `mpt-bench` sets), counting every
allocation, or else with oneDNN's allocator (CPUs with AVX512 and newer),
counting only allocations of 256 KiB and more; its default CPU allocator
keeps none, and the figures are then None. Nothing allocated outside TensorFlow's
allocator (oneDNN's and XLA's own buffers) is counted: the figures are lower
bounds, comparable between variants of one model at one size.
`variable_bytes` is exact: the bytes of the model's and optimizer's variables.

With `profile_steps`, each variant with XLA off, of any model, is then run
that many more steps under the TensorFlow profiler (`op_profile`): its op time per step by
category (matmuls and convolutions, casts, the rest) and the top op types;
for a lower precision also its matmuls' and its whole op time's speed-up over
float32's, and the speed-up its step would have if its matmuls ran at the
measured matmul peak (`op_profile.speedup_with_peak_matmuls`). With an
output directory the traces stay under `<output>/profile`, for TensorBoard's
Profile tab.

Why one module: the variants are measured together, interleaved in one
process, and every figure of a variant is a ratio to another variant's;
the pieces that stand alone (the loop and interleaving, the workloads, the
stacks, the float8 variants' layers and label, FLOPs, the op profile, the
report) are modules of their own.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from benchmarks import (
    float8_variants,
    flops,
    harness,
    matmul_peak,
    op_profile,
    stacks,
    suite_report,
    workloads,
)
from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.execution import xla
from mpt_keras.precision.hardware import HardwareProbe, probe_hardware
from mpt_keras.precision.names import COMPUTE_DTYPES, POLICY_NAMES
from mpt_keras.precision.policies import global_policy

_LOGGER = logging.getLogger(__name__)

MODELS = ("transformer_lm", "cnn", "mlp")
XLA_SETTINGS = ("off", "on")
STACKS = ("ours", "stock")
JSON_FILE = "bench.json"
PLOT_FILE = "bench.png"
PROFILE_SUBDIR = "profile"
AUTO_TOLERANCE = 1.05  # The goal: auto at most 5% slower than the better of on and off.
_MEMORY_METHOD = (
    "tf.config.experimental.get_memory_info('{device}'), one variant at a time after its "
    "first step, over {steps} train steps: peak_memory_bytes = peak - allocated before the "
    "variant was built, step_memory_bytes = peak - allocated when the steps began; counts "
    "TensorFlow's allocator only (on CPU, every allocation with TF_CPU_ALLOCATOR_USE_BFC={bfc}, "
    "else oneDNN's allocator's of 256 KiB and more): lower bounds. "
    "variable_bytes: exact bytes of the model's and optimizer's variables"
)
_FLOAT8_METHOD = (
    "a float8 variant: its twin's model with every Dense and EinsumDense layer turned by "
    "mpt_keras.precision.float8.to_float8 after the stack's manifest, before the optimizer is "
    "built; speed.vs_no_float8: its examples/s over the twin's; float8.execution: native only "
    "with XLA on GPUs of compute capability 8.9 or newer, else emulated"
)
_STEP_TIME_METHOD = (
    "median over the rounds of (seconds of steps_per_round train steps, as in model.fit, "
    "synchronised at the end) / steps_per_round; all variants interleaved round by round"
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the suite measures, and how long.

    Attributes:
        models: Reference models, of `MODELS`; `None`: all of them, or none
            with `config`.
        config: A resolved run config whose model, data and loss to measure
            instead of the reference models (`benchmarks.workloads`).
        config_name: The config's model's name in the variants' names and
            the result (no `/`).
        precisions: Global dtype policies, of `POLICY_NAMES`.
        xla: XLA settings, of `XLA_SETTINGS`.
        stacks: `ours` and/or `stock` (see the module docstring).
        rounds: Interleaved measurement rounds.
        steps_per_round: Train steps per variant and round.
        warmup_steps: Untimed steps per variant before the rounds.
        memory_steps: Train steps per variant of the memory measurement.
        batch_size: LM sequences per batch (reference models only: a config
            has its `data.batch_size`).
        sequence_length: LM tokens per sequence (reference).
        num_layers: LM Transformer blocks (reference).
        d_model: LM width (reference).
        image_batch_size: CNN and MLP images per batch (reference).
        matmul_size: Rows of the square matrices of the matmul peak.
        matmul_rounds: Interleaved rounds of the matmul peak.
        profile_steps: Steps per XLA-off variant under the TensorFlow
            profiler, after the rounds; 0 profiles nothing.
        float8: Whether each `mixed_float16` and `mixed_bfloat16` variant
            also gets its float8 twin (see the module docstring).

    Example:

        result = measure(Settings(models=("cnn",), precisions=("float32",), rounds=3))
        result["variants"]["cnn/float32/xla_off/ours"]["median_step_seconds"]

        config = mpt_keras.config.resolve_config("examples/configs/small_cnn_digits.json")
        result = measure(Settings(config=config, config_name="small_cnn_digits"))
        result["variants"]["small_cnn_digits/mixed_bfloat16/xla_on/ours"]["speed"]
    """

    models: tuple[str, ...] | None = None
    config: TrainConfig | None = None
    config_name: str = "config"
    precisions: tuple[str, ...] = POLICY_NAMES
    xla: tuple[str, ...] = XLA_SETTINGS
    stacks: tuple[str, ...] = STACKS
    rounds: int = 10
    steps_per_round: int = 10
    warmup_steps: int = 10
    memory_steps: int = 3
    batch_size: int = 32
    sequence_length: int = 64
    num_layers: int = 2
    d_model: int = 64
    image_batch_size: int = 64
    matmul_size: int = 2048
    matmul_rounds: int = 5
    profile_steps: int = 0
    float8: bool = False

    def __post_init__(self):
        if self.config is not None:
            if not isinstance(self.config, TrainConfig):
                raise UserInputError(
                    f"config: received {type(self.config).__name__}. Allowed: a TrainConfig "
                    "(mpt_keras.config.resolve_config)"
                )
            if self.models:
                raise UserInputError(
                    "models and config: received both. Allowed: reference models or a run "
                    "config, not both"
                )
            if not self.config_name or "/" in self.config_name:
                raise UserInputError(
                    f"config_name: received {self.config_name!r}. Allowed: a name without '/'"
                )
            object.__setattr__(self, "models", ())
        elif self.models is None:
            object.__setattr__(self, "models", MODELS)
        for name, allowed in (
            ("models", MODELS),
            ("precisions", POLICY_NAMES),
            ("xla", XLA_SETTINGS),
            ("stacks", STACKS),
        ):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            unknown = [value for value in values if value not in allowed]
            empty = not values and not (name == "models" and self.config is not None)
            if unknown or empty or len(set(values)) != len(values):
                problem = f"unknown '{unknown[0]}'" if unknown else f"received {list(values)}"
                raise UserInputError(
                    f"{name}: {problem}. Allowed: one or more of {', '.join(allowed)}, each once"
                )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            minimum = 0 if field.name == "profile_steps" else 1
            if field.type == "int" and (type(value) is not int or value < minimum):
                kind = "a non-negative" if minimum == 0 else "a positive"
                raise UserInputError(f"{field.name}: must be {kind} integer. Received: {value!r}")
        if self.float8 and not set(self.precisions) & set(float8_variants.PRECISIONS):
            raise UserInputError(
                f"float8: received with precisions {list(self.precisions)}. Allowed: with "
                f"{' or '.join(float8_variants.PRECISIONS)} among the precisions"
            )
        if self.d_model % 4:
            raise UserInputError(
                f"d_model: must be divisible by the 4 attention heads. Received: {self.d_model}"
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names of the models measured: the reference models, or `config_name`."""
        return self.models if self.config is None else (self.config_name,)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One measured configuration; `name` is its key in the result.

    `float8`: its Dense and EinsumDense layers train in float8.
    """

    model: str
    precision: str
    xla: str
    stack: str
    float8: bool = False

    @property
    def name(self) -> str:
        precision = self.precision + ("+float8" if self.float8 else "")
        return f"{self.model}/{precision}/xla_{self.xla}/{self.stack}"


def variants(settings: Settings) -> list[Variant]:
    """The variants `settings` selects, in measurement order (float8 ones after their twins)."""
    return [
        Variant(model, precision, xla_setting, stack, float8)
        for model in settings.model_names
        for precision in settings.precisions
        for float8 in (False, True)
        if not float8 or (settings.float8 and precision in float8_variants.PRECISIONS)
        for xla_setting in settings.xla
        for stack in settings.stacks
    ]


def measure(settings: Settings, profile_dir: str | None = None) -> dict[str, Any]:
    """Measures the matmul peak and every variant in one process; returns the JSON-ready result.

    `profile_dir` keeps the profiler traces (with `settings.profile_steps`);
    None discards them after reading.

    The keys: `benchmark`, `settings`, `models` (how each is sized: a
    config's model, its source, loss, batch size, inputs and parameters),
    `machine`, `methods` (how time, FLOPs and memory were measured),
    `matmul_peak` (see `matmul_peak.measure_matmul_peak`), `variants` (by
    `Variant.name`), `auto_jit_compile` (by `<model>/<precision>`) and, with
    `settings.float8`, `float8` (the layers turned, by model, and how).

    Raises:
        UserInputError: For a config whose model, data or loss cannot be
            resolved, loaded or built (before anything is measured).
    """
    measured_models = workloads_of(settings)
    peak = matmul_peak.measure_matmul_peak(settings.matmul_size, settings.matmul_rounds)
    measured = measure_variants(settings, measured_models, profile_dir)
    memory_device = _memory_device()
    probe = probe_hardware()
    records = {
        variant.name: _record(variant, measured_models[variant.model], measured, peak, probe)
        for variant in variants(settings)
    }
    result = {
        "benchmark": "suite",
        "settings": dataclasses.asdict(settings),
        "models": {name: dict(model.description) for name, model in measured_models.items()},
        "machine": harness.machine(),
        "methods": {
            "step_time": _STEP_TIME_METHOD,
            "flops": flops.METHOD,
            "memory": _MEMORY_METHOD.format(
                device=memory_device,
                steps=settings.memory_steps,
                bfc=os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "unset"),
            )
            if memory_device
            else "not measured: TensorFlow tracks no device's memory here",
            "speed_ratio": "examples/s of the variant over the other's (its step time over "
            "the variant's): ratio of the medians, and median of the per-round ratios",
            "op_profile": op_profile.METHOD,
        },
        "matmul_peak": peak,
        "variants": records,
        "auto_jit_compile": _auto_choices(settings, measured_models, measured.step_seconds),
    }
    if settings.float8:
        result["float8"] = {
            "layers": {model: list(paths) for model, paths in measured.float8_layers.items()},
            "method": _FLOAT8_METHOD,
        }
    return result


def workloads_of(settings: Settings) -> dict[str, workloads.Workload]:
    """The models `settings` selects, by name: the reference models, or the config's.

    Raises:
        UserInputError: As `workloads.from_config`.
    """
    if settings.config is not None:
        return {settings.config_name: workloads.from_config(settings.config, settings.config_name)}
    return {
        name: workloads.reference(
            name,
            settings.batch_size if name == workloads.LANGUAGE_MODEL else settings.image_batch_size,
            settings.sequence_length,
            settings.num_layers,
            settings.d_model,
        )
        for name in settings.models
    }


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What `measure_variants` measured.

    Attributes:
        step_seconds: Per variant name, seconds per step in each round.
        memory: Per variant name, `peak_bytes`, `step_bytes` (None where the
            device tracks no memory) and `variable_bytes`.
        train_step_flops: Per model name, FLOPs of a train step (`flops`), or
            None where they cannot be counted.
        op_seconds: Per profiled variant name, seconds per step per op type
            (`op_profile.op_seconds`).
        traces: Per profiled variant name, its trace file (None once deleted).
        float8_layers: Per model name with float8 variants, the paths of the
            layers they turn to float8.
    """

    step_seconds: dict[str, list[float]]
    memory: dict[str, dict[str, int | None]]
    train_step_flops: dict[str, int | None]
    op_seconds: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    traces: dict[str, str | None] = dataclasses.field(default_factory=dict)
    float8_layers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def measure_variants(
    settings: Settings,
    measured_models: Mapping[str, workloads.Workload],
    profile_dir: str | None = None,
) -> Measurements:
    """Builds every variant `settings` selects and times them interleaved, in this process.

    Then profiles the XLA-off variants (`settings.profile_steps`), keeping
    the traces under `profile_dir` if given.

    Args:
        settings: What to measure.
        measured_models: The models, by name (`workloads_of(settings)`).
        profile_dir: Where the profiler traces stay; None: deleted.
    """
    memory_device = _memory_device()
    selected = variants(settings)
    with tempfile.TemporaryDirectory() as log_root:
        prepared = {
            variant: _prepare(
                variant, measured_models[variant.model], settings, log_root, memory_device
            )
            for variant in selected
        }
        # After every variant is built: a variant's first steps after others
        # were built are slow (hundreds of ms, measured), so warm-up comes now.
        for ready in prepared.values():
            ready.loop(settings.warmup_steps)
        step_seconds = harness.interleave(
            {variant.name: ready.loop for variant, ready in prepared.items()},
            settings.rounds,
            settings.steps_per_round,
        )
        op_seconds, traces = {}, {}
        if settings.profile_steps:
            for variant, ready in prepared.items():
                if variant.xla == "off":
                    trace = op_profile.capture(
                        ready.loop,
                        settings.profile_steps,
                        os.path.join(profile_dir or log_root, variant.name.replace("/", "-")),
                    )
                    op_seconds[variant.name] = op_profile.op_seconds(trace, settings.profile_steps)
                    traces[variant.name] = trace if profile_dir else None
        for ready in prepared.values():
            ready.loop.end()
    train_flops = {}
    for variant, ready in prepared.items():
        if variant.model not in train_flops:
            train_flops[variant.model] = _train_step_flops(variant.model, ready)
    return Measurements(
        step_seconds=step_seconds,
        memory={variant.name: ready.memory for variant, ready in prepared.items()},
        train_step_flops=train_flops,
        op_seconds=op_seconds,
        traces=traces,
        float8_layers={
            variant.model: ready.float8_layers
            for variant, ready in prepared.items()
            if variant.float8
        },
    )


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A variant ready to be timed: its fit loop, model, input spec, memory figures, and the
    paths of its float8 layers."""

    loop: harness.FitLoop
    model: keras.Model
    input_spec: Any
    memory: dict[str, int | None]
    float8_layers: tuple[str, ...]


def _prepare(
    variant: Variant,
    workload: workloads.Workload,
    settings: Settings,
    log_root: str,
    memory_device: str | None,
) -> _Prepared:
    """Builds and compiles a variant, runs its first step (tracing), measures its memory.

    Raises:
        UserInputError: For a float8 variant of a model without a layer to turn.
    """
    # Frees what earlier work left in reference cycles (the matmul peak's
    # matrices), which would otherwise be freed during this variant's build.
    gc.collect()
    # Made before the reading: a dataset's tensors are the data's, not the variant's.
    dataset = workload.batches()
    memory_before = _memory_current(memory_device)
    with global_policy(variant.precision):
        model = workload.build()
        float8_layers = float8_variants.float8_paths(model) if variant.float8 else ()
        if variant.float8 and not float8_layers:
            raise UserInputError(
                f"float8: model '{variant.model}' has no Dense or EinsumDense layer (Keras' own "
                "classes) to train in float8. Allowed: float8 with models that have one"
            )
        callbacks = stacks.compile_stack(
            model,
            variant.precision,
            variant.xla == "on",
            stacks.PIECES if variant.stack == "ours" else (),
            os.path.join(log_root, variant.name.replace("/", "-")),
            workload.batch_size,
            loss=workload.loss,
            float8_layers=float8_layers,
        )
        iterator = iter(dataset)
        loop = harness.FitLoop(model, iterator, callbacks)
        loop(1)
    memory = _step_memory(model, iterator, settings.memory_steps, memory_device, memory_before)
    memory["variable_bytes"] = sum(
        variable.numpy().nbytes
        for variable in {id(v): v for v in (*model.weights, *model.optimizer.variables)}.values()
    )
    input_spec = keras.utils.unpack_x_y_sample_weight(dataset.element_spec)[0]
    return _Prepared(loop, model, input_spec, memory, float8_layers)


def _train_step_flops(name: str, ready: _Prepared) -> int | None:
    """The train step's FLOPs, or None (and a warning) where they cannot be counted."""
    try:
        return flops.train_step_flops(ready.model, ready.input_spec)
    except Exception as error:  # Any model's tracing: a count missing, never a crash.
        _LOGGER.warning(
            "%s: train step FLOPs not counted (%s: %s)", name, type(error).__name__, error
        )
        return None


def _memory_device() -> str | None:
    """The device whose allocator statistics the suite reads, if it tracks any."""
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    try:
        tf.config.experimental.get_memory_info(device)
    except ValueError:
        return None
    return device


def _memory_current(device: str | None) -> int:
    return tf.config.experimental.get_memory_info(device)["current"] if device else 0


def _step_memory(
    model: keras.Model, iterator: Any, steps: int, device: str | None, memory_before: int
) -> dict[str, int | None]:
    """The allocator's peak during `steps` train steps: above `memory_before`, and above
    what was allocated when the steps began."""
    if device is None:
        return {"peak_bytes": None, "step_bytes": None}
    resident = _memory_current(device)
    tf.config.experimental.reset_memory_stats(device)
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return {"peak_bytes": peak - memory_before, "step_bytes": peak - resident}


def _record(
    variant: Variant,
    workload: workloads.Workload,
    measured: Measurements,
    peak: dict[str, Any],
    probe: HardwareProbe,
) -> dict[str, Any]:
    step_seconds = measured.step_seconds
    memory = measured.memory[variant.name]
    train_flops = measured.train_step_flops[variant.model]
    seconds = step_seconds[variant.name]
    median = statistics.median(seconds)
    batch_size = workload.batch_size
    flops_per_second = None if train_flops is None else train_flops / median
    compute_dtype = COMPUTE_DTYPES[variant.precision]

    def speed_over(**changes: Any) -> dict[str, float] | None:
        other = dataclasses.replace(variant, **changes).name
        if other == variant.name or other not in step_seconds:
            return None
        return harness.ratio(step_seconds[other], seconds)

    return {
        "model": variant.model,
        "precision": variant.precision,
        "compute_dtype": compute_dtype,
        "xla": variant.xla == "on",
        "stack": variant.stack,
        "step_seconds": seconds,
        "median_step_seconds": median,
        "examples_per_second": batch_size / median,
        "tokens_per_second": (
            batch_size * workload.tokens_per_example / median
            if workload.tokens_per_example
            else None
        ),
        "train_step_flops": train_flops,
        "flops_per_second": flops_per_second,
        "fraction_of_matmul_peak": (
            None
            if flops_per_second is None
            else flops_per_second / peak["flops_per_second"][compute_dtype]
        ),
        "peak_memory_bytes": memory["peak_bytes"],
        "step_memory_bytes": memory["step_bytes"],
        "variable_bytes": memory["variable_bytes"],
        "speed": {
            "vs_float32": speed_over(precision="float32", float8=False),
            "vs_stock": speed_over(stack="stock") if variant.stack == "ours" else None,
            "vs_no_xla": speed_over(xla="off") if variant.xla == "on" else None,
            "vs_no_float8": speed_over(float8=False) if variant.float8 else None,
        },
        "op_profile": variant_op_profile(variant, measured, peak),
        "float8": _float8_execution(variant, probe),
    }


def _float8_execution(variant: Variant, probe: HardwareProbe) -> dict[str, str] | None:
    """A float8 variant's `{"execution": "emulated" or "native", "reason": ...}`; else None."""
    if not variant.float8:
        return None
    execution, reason = float8_variants.execution(probe, variant.xla == "on")
    return {"execution": execution, "reason": reason}


def variant_op_profile(
    variant: Variant, measured: Measurements, peak: dict[str, Any]
) -> dict[str, Any] | None:
    """The variant's profiled op time by category, and what limits its precision's speed-up."""
    seconds = measured.op_seconds.get(variant.name)
    if seconds is None:
        return None
    categories = op_profile.breakdown(seconds)
    profile: dict[str, Any] = {
        "seconds_per_step": categories,
        "fractions": {
            name: categories[name] / categories["total"] for name in op_profile.CATEGORIES
        },
        "top_ops": dict(list(seconds.items())[:8]),
        "trace": measured.traces[variant.name],
        "matmul_speedup_vs_float32": None,
        "op_time_speedup_vs_float32": None,
        "speedup_with_peak_matmuls": None,
    }
    float32_variant = dataclasses.replace(variant, precision="float32", float8=False)
    float32 = measured.op_seconds.get(float32_variant.name)
    if variant.precision != "float32" and float32 is not None:
        reference = op_profile.breakdown(float32)
        peaks = peak["flops_per_second"]
        profile["matmul_speedup_vs_float32"] = reference["matmul"] / categories["matmul"]
        profile["op_time_speedup_vs_float32"] = reference["total"] / categories["total"]
        profile["speedup_with_peak_matmuls"] = op_profile.speedup_with_peak_matmuls(
            reference, categories, peaks[COMPUTE_DTYPES[variant.precision]] / peaks["float32"]
        )
    return profile


def _auto_choices(
    settings: Settings,
    measured_models: Mapping[str, workloads.Workload],
    step_seconds: dict[str, list[float]],
) -> dict[str, Any]:
    """Per (model, precision): what `auto` picks, and its step time over the better choice."""
    stack = "ours" if "ours" in settings.stacks else settings.stacks[0]
    strategy = tf.distribute.get_strategy()
    choices = {}
    for model, workload in measured_models.items():
        built = workload.build()
        for precision in settings.precisions:
            jit_compile, reason = xla.resolve_jit_compile("auto", strategy, precision, built)
            times = {
                setting: step_seconds[Variant(model, precision, setting, stack).name]
                for setting in settings.xla
            }
            entry: dict[str, Any] = {
                "stack": stack,
                "jit_compile": jit_compile,
                "reason": reason,
                "step_time_over_best": None,
                "paired_step_time_over_best": None,
                "tolerance": AUTO_TOLERANCE,
                "within_tolerance": None,
            }
            if len(times) == 2:
                chosen, other = ("on", "off") if jit_compile else ("off", "on")
                over_other = harness.ratio(times[chosen], times[other])
                entry["step_time_over_best"] = max(1.0, over_other["ratio"])
                entry["paired_step_time_over_best"] = max(1.0, over_other["paired_ratio_median"])
                entry["within_tolerance"] = entry["step_time_over_best"] <= AUTO_TOLERANCE
            choices[f"{model}/{precision}"] = entry
    return choices


def run(settings: Settings, output_dir: str | None = None) -> dict[str, Any]:
    """Measures, prints the table, and writes `bench.json` and `bench.png` to `output_dir`.

    Profiler traces (with `settings.profile_steps`) go to
    `output_dir/profile`.

    Raises:
        UserInputError: If `output_dir` cannot be created.
    """
    if output_dir:
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as error:
            raise UserInputError(
                f"output: {output_dir} cannot be created ({error.strerror})"
            ) from None
    profile_dir = os.path.join(output_dir, PROFILE_SUBDIR) if output_dir else None
    result = measure(settings, profile_dir)
    print(suite_report.table(result), end="", flush=True)
    if output_dir:
        with open(os.path.join(output_dir, JSON_FILE), "w") as file:
            json.dump(result, file, indent=2)
        with open(os.path.join(output_dir, PLOT_FILE), "wb") as file:
            file.write(suite_report.plot(result))
    return result

"""The run assembly: the model with its precision, compiled with our step and optimizer;
`plan_precision`, what `--dry_run` prints of it.

Every run (`mpt-train`, validation, the canary) is assembled here, so validation speaks for
the real run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.config import OptimizerConfig, TrainConfig
from mpt_keras.data import RunData
from mpt_keras.errors import UserInputError, first_line
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.float8 import is_float8
from mpt_keras.precision.float8_census import take_census
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.report import PrecisionReport
from mpt_keras.reliability.guards import ScaledLearningRate
from mpt_keras.runs.precision_plan import build_model
from mpt_keras.runs.resolution import Components, resolve_components
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Run:
    """A model ready to train; `report`: `plan_precision`'s, with `jit_compile` resolved."""

    model: keras.Model
    manifest: PrecisionManifest
    report: PrecisionReport
    optimizer: LossScaleOptimizer
    jit_compile: bool


def assemble(
    config: TrainConfig,
    components: Components,
    data: RunData,
    manifest_file: PrecisionManifest | None = None,
) -> Run:
    """Builds the run's model with its precision and optimizer, and compiles it; call under
    the run's strategy scope, if any (`jit_compile` resolves for it)."""
    model, manifest, report = build_model(config, components, data, manifest_file)
    optimizer, report = _compile(model, config, components, report, data.labels)
    batch = data.first_batch(config.data.batch_size)
    _check_loss_fits(model, batch)
    _check_lowers(model, report, batch)
    return Run(model, manifest, report, optimizer, report.jit_compile)


def plan_precision(config: TrainConfig, census_target: str | None = None) -> PrecisionReport:
    """Each layer's precision in the run's untrained model (`--dry_run`), with `jit_compile`.

    With float8 layers, the train step is compiled as the run would compile it (never run)
    and the report holds its float8 census: which of their GEMMs really run in float8, on
    this machine's device or, on JAX, on the GPU `census_target` (`GPU_TARGETS`).
    """
    components = resolve_components(config)
    data = components.data()
    model, _, report = build_model(config, components, data)
    float8 = any(is_float8(layer) for _, layer in iter_layers(model))
    lowering = census_target is None and _may_not_lower(report)  # A target is a GPU.
    if not float8 and not lowering:
        return report
    _, report = _compile(model, config, components, report, data.labels)
    batch = data.first_batch(config.data.batch_size)  # The step's shapes: compiled, never run.
    if lowering:
        _check_lowers(model, report, batch)
    if not float8:
        return report
    census = take_census(model, batch, xla=bool(report.jit_compile), target=census_target)
    return dataclasses.replace(report, float8_census=census)


def _compile(
    model: keras.Model,
    config: TrainConfig,
    components: Components,
    report: PrecisionReport,
    labels: Any,
) -> tuple[LossScaleOptimizer, PrecisionReport]:
    """Compiles `model` with the run's optimizer (built), loss and metrics (on each output, as
    the model's graph or the data's `labels` has them); the report with `jit_compile`
    resolved."""
    optimizer = make_optimizer(config, report)
    compiled = {
        "optimizer": optimizer,
        "loss": components.loss,
        "metrics": _metrics_per_output(model, components.metrics, labels),
    }
    if current.is_jax():
        jit_compile, jit_reason = jax_jit_compile(config.jit_compile)
        model.compile(**compiled, jit_compile=jit_compile)  # Our step: scaling.compile_hook.
    else:
        from mpt_keras.backend.tensorflow.distribute import current_strategy
        from mpt_keras.execution import jit_rule, xla

        jit_compile, jit_reason = jit_rule.resolve_jit_compile(
            config.jit_compile,
            current_strategy(),
            report.precision,
            model,
            deterministic=config.deterministic,
        )
        xla.compile_model(model, **compiled, jit_compile=jit_compile)
    _LOGGER.info("%s", jit_reason)
    report = dataclasses.replace(report, jit_compile=jit_compile, jit_compile_reason=jit_reason)
    optimizer.build(model.trainable_variables)
    return optimizer, report


def _check_loss_fits(model: keras.Model, batch: tuple[Any, ...]) -> None:
    """Refuses, before anything is written, a loss or metric that cannot take the model's
    outputs and the data's labels (`mse` on class ids): it failed at the first step, after
    the run had written its config, which then held a rerun on that model_dir to the bad loss.

    Builds the loss and metrics from a batch's shapes, as `fit` would at its start
    (no device work). A model whose forward pass cannot be built so is left to its first step.
    """
    try:
        compat.symbolic_build(model, batch)
    except Exception as error:  # The user's loss, metrics or model: which, told below.
        x, y, _ = keras.utils.unpack_x_y_sample_weight(batch)
        try:
            outputs = model.compute_output_spec(_specs(x))
        except Exception:
            return  # The forward pass: the first step builds it, as Keras would.
        raise UserInputError(
            f"the loss or a metric cannot take the model's outputs {_shapes(outputs)} and the "
            f"labels {_shapes(y)} of the data's first examples ({type(error).__name__}: "
            f"{first_line(error).rstrip('.')}). Allowed: a loss and metrics for those outputs "
            "and labels"
        ) from None


def _specs(nest: Any) -> Any:
    return keras.tree.map_structure(
        lambda value: keras.KerasTensor(value.shape, keras.backend.standardize_dtype(value.dtype)),
        nest,
    )


def _shapes(nest: Any) -> str:
    """`float32 (64, 10)`, or a dict or list of them, for a message."""
    described = keras.tree.map_structure(
        lambda value: f"{keras.backend.standardize_dtype(value.dtype)} {tuple(value.shape)}", nest
    )
    return str(described).replace("'", "")


def _check_lowers(model: keras.Model, report: PrecisionReport, batch: tuple[Any, ...]) -> None:
    """Refuses, before anything is written, a float16 step that Keras' JAX backend cannot
    compile on this device (`unlowerable_float16_dot`: a CPU's, for float16 attention)."""
    if not (report.jit_compile and _may_not_lower(report)):
        return
    from mpt_keras.backend.jax.compiled import unlowerable_float16_dot

    reason = unlowerable_float16_dot(model, batch)
    if reason is None:
        return
    float16 = [layer.path for layer in report.layers if layer.compute_dtype == "float16"]
    attention = [
        layer.path
        for layer in report.layers
        if "Attention" in layer.layer_class
        and any(path == layer.path or path.startswith(layer.path + "/") for path in float16)
    ]
    named = f" (attention layers computing float16: {', '.join(attention)})" if attention else ""
    raise UserInputError(
        "float16 layers: the train step does not compile on Keras' JAX backend "
        f"on this device ({reason}): jax.nn.dot_product_attention, which Keras' attention "
        f"layers call, sums float16 in float32, which JAX lowers on a GPU, not here{named}. "
        "Allowed here: mixed_bfloat16 or float32, a manifest rule keeping those layers and their "
        "sublayers in float32, or jit_compile false; float16 compiles on a GPU"
    )


def _may_not_lower(report: PrecisionReport) -> bool:
    """Whether the float16 layers' step may not compile: on Keras' JAX backend, on a device
    whose XLA lacks float16 sums in float32 (a CPU; a GPU has them: nothing to trace)."""
    if not (current.is_jax() and _computes_float16(report)):
        return False
    from mpt_keras.backend.jax.compiled import lacks_float16_sums

    return lacks_float16_sums()


def _computes_float16(report: PrecisionReport) -> bool:
    return any(layer.compute_dtype == "float16" for layer in report.layers)


def _metrics_per_output(
    model: keras.Model, makers: Sequence[Callable[[], Any]], labels: Any
) -> Any:
    """The run's metrics, each on every output of a model of several (Keras 3 takes a flat
    list for one output only): `{"digit": [acc], "parity": [acc]}`. The outputs are the
    model's graph's, or for a subclassed model (no graph) as its labels are."""
    outputs = model.output if getattr(model, "outputs", None) else labels
    if not isinstance(outputs, (dict, list, tuple)) or len(outputs) < 2:
        return [make() for make in makers]
    return keras.tree.map_structure(lambda _: [make() for make in makers], outputs)


def make_optimizer(config: TrainConfig, report: PrecisionReport) -> LossScaleOptimizer:
    """The run's `LossScaleOptimizer`, its learning rate scalable by a rollback.

    Dynamic loss scaling when a layer computes in float16; else the scale is pinned at 1
    (non-finite steps still skipped and counted).
    """
    settings = config.optimizer
    learning_rate = ScaledLearningRate(_learning_rate(settings, config.steps))
    clipping = {"global_clipnorm": settings.global_clipnorm}
    if settings.name == "adam":
        inner = keras.optimizers.Adam(learning_rate, **clipping)
    elif settings.name == "adamw":
        inner = keras.optimizers.AdamW(
            learning_rate, weight_decay=settings.weight_decay, **clipping
        )
    else:
        inner = keras.optimizers.SGD(learning_rate, momentum=0.9, **clipping)
    if _computes_float16(report):
        scaling = dataclasses.asdict(config.loss_scale)
    else:
        scaling = {"initial_scale": 1.0, "min_scale": 1.0, "max_scale": 1.0, "dynamic": False}
    return LossScaleOptimizer(inner, **scaling)  # The config checked the settings.


def jax_jit_compile(setting: str) -> tuple[bool, str]:
    """`(jit_compile, reason)` on JAX, where Keras compiles each step with XLA unless told not."""
    if setting == "auto":
        return True, "jit_compile=auto: on Keras' jax backend XLA compiles every step"
    return setting == "true", f"jit_compile={setting}: as set"


def learning_rate_scale(optimizer: LossScaleOptimizer) -> keras.Variable:
    """The `ScaledLearningRate` scale `make_optimizer` gave `optimizer`."""
    return compat.learning_rate_schedule(optimizer.inner_optimizer).scale


def _learning_rate(
    settings: OptimizerConfig, steps: int
) -> float | keras.optimizers.schedules.LearningRateSchedule:
    if settings.schedule == "constant" and not settings.warmup_steps:
        return settings.learning_rate
    warmup = settings.warmup_steps
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else settings.learning_rate,
        decay_steps=max(1, steps - warmup),
        alpha=1.0 if settings.schedule == "constant" else 0.0,
        warmup_target=settings.learning_rate if warmup else None,
        warmup_steps=warmup,
    )

"""Measuring the variants: build each, read its memory, time them all interleaved, profile.

All are built before any is timed: a variant's first steps after others were
built are slow (hundreds of ms, measured).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import keras

from benchmarks import (
    float8_variants,
    flops,
    harness,
    op_profile,
    stacks,
    variant_memory,
    workloads,
)
from benchmarks.suite_settings import Settings, Variant, variants
from mpt_keras.checks import refusal
from mpt_keras.precision.float8_census import Float8Census, take_census
from mpt_keras.precision.policies import global_policy

_LOGGER = logging.getLogger(__name__)

STEP_TIME_METHOD = (
    "median over the rounds of (seconds of steps_per_round train steps, as in model.fit, "
    "synchronised at the end) / steps_per_round; all variants interleaved round by round"
)


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What `measure_variants` measured, per variant name (FLOPs and float8 layers: per model).

    `memory` holds `peak_bytes`, `step_bytes` (None where the device keeps no
    statistics) and `variable_bytes`; `traces` None once deleted.
    """

    step_seconds: dict[str, list[float]]
    memory: dict[str, dict[str, int | None]]
    train_step_flops: dict[str, int | None]
    op_seconds: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    traces: dict[str, str | None] = dataclasses.field(default_factory=dict)
    float8_layers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    float8_census: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def measure_variants(
    settings: Settings,
    measured_models: Mapping[str, workloads.Workload],
    profile_dir: str | None = None,
) -> Measurements:
    """Builds every variant `settings` selects, times them interleaved, then profiles the
    XLA-off ones, keeping the traces under `profile_dir` if given."""
    memory_device = variant_memory.memory_device()
    selected = variants(settings)
    with tempfile.TemporaryDirectory() as log_root:
        prepared = {
            variant: _prepare(
                variant, measured_models[variant.model], settings, log_root, memory_device
            )
            for variant in selected
        }
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
        float8_census={
            variant.name: ready.float8_census.to_dict()
            for variant, ready in prepared.items()
            if ready.float8_census is not None
        },
    )


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A variant ready to be timed."""

    loop: harness.FitLoop
    model: keras.Model
    input_spec: Any
    memory: dict[str, int | None]
    float8_layers: tuple[str, ...]
    float8_census: Float8Census | None


def _prepare(
    variant: Variant,
    workload: workloads.Workload,
    settings: Settings,
    log_root: str,
    memory_device: str | None,
) -> _Prepared:
    """Builds and compiles a variant, runs its first step (tracing), reads its memory.

    Raises:
        UserInputError: For a float8 variant of a model without a layer to turn.
    """
    # Frees earlier reference cycles (the matmul peak's), not to free them mid-reading.
    gc.collect()
    # Made before the reading: a dataset's tensors are the data's, not the variant's.
    dataset = workload.batches()
    memory_before = variant_memory.current_bytes(memory_device)
    with global_policy(variant.precision):
        model = workload.build()
        float8_layers = float8_variants.float8_paths(model) if variant.float8 else ()
        if variant.float8 and not float8_layers:
            raise refusal(
                "float8",
                f"model '{variant.model}', without a Dense or EinsumDense layer (Keras' own "
                "classes) to train in float8",
                "float8 with models that have one",
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
        iterator = harness.step_iterator(dataset)
        loop = harness.FitLoop(model, iterator, callbacks)
        loop(1)
    memory = variant_memory.step_memory(
        model, iterator, settings.memory_steps, memory_device, memory_before
    )
    loop.sync()  # What follows reads the variables.
    memory["variable_bytes"] = variant_memory.variable_bytes(model)
    input_spec = harness.input_spec(dataset)
    census = None
    if variant.float8:  # After the memory reading: the census compiles the step again.
        census = take_census(model, next(iter(dataset)), xla=variant.xla == "on")
    return _Prepared(loop, model, input_spec, memory, float8_layers, census)


def _train_step_flops(name: str, ready: _Prepared) -> int | None:
    """The train step's FLOPs, or None (and a warning) where they cannot be counted."""
    try:
        return flops.train_step_flops(ready.model, ready.input_spec)
    except Exception as error:  # Any model's tracing: a count missing, never a crash.
        _LOGGER.warning(
            "%s: train step FLOPs not counted (%s: %s)", name, type(error).__name__, error
        )
        return None

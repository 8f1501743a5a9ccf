"""The benchmark suite behind `mpt-bench`: every variant side by side, against the machine's limit.

A variant is a model (`benchmarks.workloads`: a reference model, or a run
config's own, whose precision, manifest, optimizer, metrics, strategy and XLA
setting give way to the variants'), a precision, XLA on or off, a stack
(`benchmarks.stacks`) and, with `float8`, float8 layers
(`benchmarks.float8_variants`).

Every figure of a variant is a ratio to another variant's or to the matmul
peak, so all are built, warmed up, then timed in ONE process, interleaved
round by round (`benchmarks.measuring`): machine drift cancels. What each
field of the result means is in docs/benchmarks.md and its `methods`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from benchmarks import (
    auto_choice,
    float8_variants,
    flops,
    harness,
    matmul_peak,
    measuring,
    op_profile,
    suite_report,
    variant_memory,
    variant_records,
    workloads,
)
from benchmarks.suite_settings import Settings, variants
from mpt_keras.backend import current
from mpt_keras.errors import UserInputError
from mpt_keras.files import check_writable_dir
from mpt_keras.precision.hardware import probe_hardware

JSON_FILE = "bench.json"
PLOT_FILE = "bench.png"
PROFILE_SUBDIR = "profile"


def measure(settings: Settings, profile_dir: str | None = None) -> dict[str, Any]:
    """Measures the matmul peak and every variant in one process; returns the JSON-ready result.

    `profile_dir` keeps the profiler traces; None discards them after reading.

    Raises:
        UserInputError: For a config whose model, data or loss cannot be
            resolved, loaded or built, or `profile_steps` on JAX (before anything is
            measured).
    """
    if settings.profile_steps and current.is_jax():
        raise UserInputError(
            f"profile_steps {settings.profile_steps}: the op profile reads TensorFlow's "
            "profiler, and this is Keras' JAX backend. Allowed here: 0 (no profile)"
        )
    measured_models = workloads_of(settings)
    peak = matmul_peak.measure_matmul_peak(settings.matmul_size, settings.matmul_rounds)
    measured = measuring.measure_variants(settings, measured_models, profile_dir)
    probe = probe_hardware()
    records = {
        variant.name: variant_records.variant_record(
            variant, measured_models[variant.model], measured, peak, probe
        )
        for variant in variants(settings)
    }
    result = {
        "benchmark": "suite",
        # The config as config.json writes it: the run-decided settings stay out.
        "settings": {
            **dataclasses.asdict(settings),
            "config": settings.config.to_dict() if settings.config is not None else None,
        },
        "models": {name: dict(model.description) for name, model in measured_models.items()},
        "machine": harness.machine(),
        "methods": {
            "step_time": measuring.STEP_TIME_METHOD,
            "flops": flops.METHOD,
            "memory": variant_memory.method(variant_memory.memory_device(), settings.memory_steps),
            "speed_ratio": variant_records.SPEED_RATIO_METHOD,
            "op_profile": op_profile.METHOD,
        },
        "matmul_peak": peak,
        "variants": records,
        "auto_jit_compile": auto_choice.auto_choices(
            settings, measured_models, measured.step_seconds
        ),
    }
    if settings.float8:
        result["float8"] = {
            "layers": {model: list(paths) for model, paths in measured.float8_layers.items()},
            "method": float8_variants.METHOD,
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


def run(settings: Settings, output_dir: str | None = None) -> dict[str, Any]:
    """Measures, prints the table, and writes `bench.json`, `bench.png` and the profiler
    traces (`profile/`) to `output_dir` if given.

    Raises:
        UserInputError: If `output_dir` cannot be created.
    """
    if output_dir:
        check_writable_dir(output_dir, "output", min_free_bytes=0)
    profile_dir = os.path.join(output_dir, PROFILE_SUBDIR) if output_dir else None
    result = measure(settings, profile_dir)
    print(suite_report.table(result), end="", flush=True)
    if output_dir:
        with open(os.path.join(output_dir, JSON_FILE), "w") as file:
            json.dump(result, file, indent=2)
        with open(os.path.join(output_dir, PLOT_FILE), "wb") as file:
            file.write(suite_report.plot(result))
    return result

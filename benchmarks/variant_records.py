"""A variant's record in the result: its speed, FLOP/s, memory, ratios and op profile.

Each ratio compares it with another variant of the same run (`harness.ratio`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from benchmarks import float8_variants, harness, op_profile, workloads
from benchmarks.measuring import Measurements
from benchmarks.suite_settings import Variant
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.names import COMPUTE_DTYPES

SPEED_RATIO_METHOD = (
    "examples/s of the variant over the other's (its step time over the variant's): ratio of "
    "the medians, and median of the per-round ratios"
)


def variant_record(
    variant: Variant,
    workload: workloads.Workload,
    measured: Measurements,
    peak: dict[str, Any],
    probe: HardwareProbe,
) -> dict[str, Any]:
    """The JSON-ready record of `variant` (docs/benchmarks.md says what each field is).

    Args:
        peak: The matmul peak (`matmul_peak.measure_matmul_peak`).
        probe: The machine, for whether float8 is emulated.
    """
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
        "float8": _float8_execution(variant, probe, measured.float8_census.get(variant.name)),
    }


def _float8_execution(
    variant: Variant, probe: HardwareProbe, census: dict[str, Any] | None
) -> dict[str, Any] | None:
    """A float8 variant's `{"execution", "reason", "census"}`, else None: `execution` is
    `emulated`, or on a device with float8 GEMMs what the census of its compiled step found
    (`native` only if every float8 GEMM runs in float8)."""
    if not variant.float8:
        return None
    execution, reason = float8_variants.execution(probe, variant.xla == "on")
    if census is not None and execution == float8_variants.NATIVE:
        execution = float8_variants.CENSUS_EXECUTION[census["state"]]
        reason = census["summary"]
    return {"execution": execution, "reason": reason, "census": census}


def variant_op_profile(
    variant: Variant, measured: Measurements, peak: dict[str, Any]
) -> dict[str, Any] | None:
    """The variant's profiled op time by category, and what limits its precision's speed-up.

    None if it was not profiled; the speed-ups over float32 are None without a
    profiled float32 twin.
    """
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

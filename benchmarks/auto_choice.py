"""Checks `jit_compile="auto"`: what it picks per model and precision, against the faster choice.

The goal: `auto` at most `AUTO_TOLERANCE` times the step time of the better of XLA on and off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks import harness, workloads
from benchmarks.suite_settings import Settings, Variant
from mpt_keras.backend import current

AUTO_TOLERANCE = 1.05


def auto_choices(
    settings: Settings,
    measured_models: Mapping[str, workloads.Workload],
    step_seconds: dict[str, list[float]],
) -> dict[str, Any]:
    """Per `<model>/<precision>`: what `auto` picks, and its step time over the better choice.

    The times are those of the `ours` stack (else the first measured); they
    are compared only when both XLA settings were measured (else None).
    """
    stack = "ours" if "ours" in settings.stacks else settings.stacks[0]
    choices = {}
    for model, workload in measured_models.items():
        built = workload.build()
        for precision in settings.precisions:
            jit_compile, reason = _auto(precision, built)
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


def _auto(precision: str, model: Any) -> tuple[bool, str]:
    """What `jit_compile="auto"` picks for `model` in `precision`, and why: the run's rule."""
    if current.is_jax():
        from mpt_keras.runs.assembly import jax_jit_compile

        return jax_jit_compile("auto")
    import tensorflow as tf

    from mpt_keras.execution import jit_rule

    return jit_rule.resolve_jit_compile("auto", tf.distribute.get_strategy(), precision, model)

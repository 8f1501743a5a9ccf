"""The benchmark suite's outputs, the table on stdout and the plot, from its JSON-ready result."""

from __future__ import annotations

from typing import Any

from benchmarks import result_files


def table(result: dict[str, Any]) -> str:
    """The result as a text table: one row per variant, then the float8, peak and `auto` lines."""
    peak = result["matmul_peak"]
    peaks = peak["flops_per_second"]
    ceilings = {dtype: peaks[dtype] / peaks["float32"] for dtype in peaks}
    labels = {name: _label(name, row) for name, row in result["variants"].items()}
    width = max(len("variant"), *map(len, labels.values()))
    header = (
        f"{'variant':<{width}} {'step ms':>8} {'ex/s':>8} {'tok/s':>8} {'GFLOP/s':>8} "
        f"{'%peak':>6} {'mem MiB':>8} {'/f32':>5} {'(ceil)':>6} {'/stock':>6} {'/noXLA':>6}"
    )
    lines = [header]
    for name, row in result["variants"].items():
        speed = row["speed"]
        lines.append(
            f"{labels[name]:<{width}} {row['median_step_seconds'] * 1e3:>8.2f} "
            f"{row['examples_per_second']:>8.0f} {_number(row['tokens_per_second'], 8, 0)} "
            f"{_number(_scaled(row['flops_per_second'], 1e-9), 8, 2)} "
            f"{_percent(row['fraction_of_matmul_peak'])} "
            f"{_number(_mib(row['peak_memory_bytes']), 8, 1)} "
            f"{_number(_ratio(speed['vs_float32']), 5, 2)} "
            f"{'(' + format(ceilings[row['compute_dtype']], '.2f') + ')':>6} "
            f"{_number(_ratio(speed['vs_stock']), 6, 2)} "
            f"{_number(_ratio(speed['vs_no_xla']), 6, 2)}"
        )
    lines.append(
        "ratios: examples/s over float32 (ceiling: the dtype's matmul peak over float32's), "
        "over stock, over XLA off; above 1 faster"
    )
    lines += _float8_lines(result, labels)
    lines.append(
        f"matmul peak ({peak['size']}x{peak['size']}, median of {peak['rounds']} rounds): "
        + ", ".join(
            f"{dtype} {value / 1e9:.1f} GFLOP/s ({ceilings[dtype]:.2f}x)"
            for dtype, value in peaks.items()
        )
    )
    lines += _profile_lines(result)
    for key, auto in result["auto_jit_compile"].items():
        choice = "XLA on" if auto["jit_compile"] else "XLA off"
        if auto["step_time_over_best"] is None:
            verdict = "not compared (needs --xla=off,on)"
        else:
            verdict = (
                f"step time {auto['step_time_over_best']:.3f}x the better of on/off "
                f"(paired {auto['paired_step_time_over_best']:.3f}x): "
                + ("ok" if auto["within_tolerance"] else f"MORE than {auto['tolerance']:.2f}x")
            )
        lines.append(f"jit_compile=auto {key}: {choice}; {verdict}")
    machine = result["machine"]
    lines.append(
        f"machine: {machine['cpu']}, {machine['cpu_count']} cores, "
        f"flags {' '.join(machine['cpu_flags']) or 'none'}; "
        f"{result_files.backend_version(machine)}, Keras {machine['keras']}"
    )
    return "\n".join(lines) + "\n"


def _label(name: str, row: dict[str, Any]) -> str:
    """A variant's name, a float8 one's with `(emulated)` or `(native)` (older results:
    no `float8` field)."""
    float8 = row.get("float8")
    return f"{name} ({float8['execution']})" if float8 else name


def _float8_lines(result: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """Each float8 variant's speed over its twin, and how float8 ran, plainly."""
    rows = {name: row for name, row in result["variants"].items() if row.get("float8")}
    if not rows:
        return []
    layers = result["float8"]["layers"]
    counts = ", ".join(f"{model} {len(paths)}" for model, paths in layers.items())
    width = max(len(labels[name]) for name in rows)
    lines = [
        f"float8 variants (Dense and EinsumDense layers in float8: {counts}): examples/s over "
        "the same variant without float8"
    ]
    ratios: dict[tuple[str, str], list[float]] = {}
    for name, row in rows.items():
        speed = row["speed"]["vs_no_float8"]
        lines.append(
            f"{labels[name]:<{width}} {speed['ratio']:>5.2f} "
            f"(paired {speed['paired_ratio_median']:.2f}): {_verdict(speed['ratio'])}"
        )
        float8 = row["float8"]
        ratios.setdefault((float8["execution"], float8["reason"]), []).append(speed["ratio"])
    for (execution, reason), measured in ratios.items():
        slower = sum(ratio < 1 for ratio in measured)
        lines.append(
            f"float8 is {execution} here, and slower in {slower} of {len(measured)} "
            f"variants: {reason}"
        )
    return lines


def _verdict(ratio: float) -> str:
    return "slower" if ratio < 1 else "faster" if ratio > 1 else "as fast"


def _profile_lines(result: dict[str, Any]) -> list[str]:
    """The op-time breakdown of the profiled variants, if any."""
    profiled = {
        name: row["op_profile"] for name, row in result["variants"].items() if row["op_profile"]
    }
    if not profiled:
        return []
    width = max(len("profiled variant"), *map(len, profiled))
    lines = [
        f"{'profiled variant':<{width}} {'op ms':>8} {'matmul':>7} {'cast':>6} {'other':>6} "
        f"{'mm/f32':>6} {'op/f32':>6} {'@peak':>6}  top op types (ms)"
    ]
    for name, profile in profiled.items():
        fractions = profile["fractions"]
        top = ", ".join(
            f"{op} {seconds * 1e3:.2f}" for op, seconds in list(profile["top_ops"].items())[:4]
        )
        lines.append(
            f"{name:<{width}} {profile['seconds_per_step']['total'] * 1e3:>8.2f} "
            f"{fractions['matmul'] * 100:>6.1f}% {fractions['cast'] * 100:>5.1f}% "
            f"{fractions['other'] * 100:>5.1f}% "
            f"{_number(profile['matmul_speedup_vs_float32'], 6, 2)} "
            f"{_number(profile['op_time_speedup_vs_float32'], 6, 2)} "
            f"{_number(profile['speedup_with_peak_matmuls'], 6, 2)}  {top}"
        )
    lines.append(
        "op time per step from the TensorFlow profiler (XLA off; summed over threads); "
        "mm/f32, op/f32: float32's matmul and op time over this variant's; @peak: op/f32 were "
        "the matmuls float32's at the matmul peak ratio, the other ops as measured"
    )
    return lines


def plot(result: dict[str, Any]) -> bytes:
    """The achieved GFLOP/s per variant (no bar without FLOPs) against the matmul peaks, as PNG."""
    # Here, not at the top: the table (and the docs' tables) need no TensorFlow.
    from benchmarks import chart

    short = {
        "transformer_lm": "lm",
        "float32": "f32",
        "mixed_bfloat16": "bf16",
        "mixed_float16": "f16",
        "float8": "f8",
    }
    bars = [
        (
            " ".join(
                "+".join(short.get(piece, piece) for piece in part.split("+"))
                for part in name.split("/")
            ),
            row["precision"],
            row["flops_per_second"] / 1e9,
        )
        for name, row in result["variants"].items()
        if row["flops_per_second"] is not None
    ]
    peaks = {
        dtype: value / 1e9 for dtype, value in result["matmul_peak"]["flops_per_second"].items()
    }
    return chart.plot_throughput(bars, peaks)


def _number(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ratio(speed: dict[str, float] | None) -> float | None:
    return None if speed is None else speed["ratio"]


def _mib(value: int | None) -> float | None:
    return _scaled(value, 2**-20)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _percent(fraction: float | None) -> str:
    return f"{'-':>6}" if fraction is None else f"{fraction * 100:>5.1f}%"

"""The monitor overhead harness runs (at a tiny size) and reports every field."""

from benchmarks import monitor_overhead


def test_monitor_overhead_reports_both_variants_and_their_ratio():
    result = monitor_overhead.measure(
        rounds=2,
        steps_per_round=2,
        warmup_steps=1,
        update_freq=1,
        batch_size=2,
        sequence_length=8,
        num_layers=1,
        d_model=8,
    )
    assert set(result) == {
        "benchmark",
        "model",
        "policy",
        "update_freq",
        "rounds",
        "steps_per_round",
        "median_step_seconds",
        "step_seconds",
        "ratio",
        "paired_ratio_median",
        "devices",
    }
    assert set(result["median_step_seconds"]) == {"without_monitor", "with_monitor"}
    assert all(len(times) == 2 for times in result["step_seconds"].values())
    assert result["ratio"] == (
        result["median_step_seconds"]["with_monitor"]
        / result["median_step_seconds"]["without_monitor"]
    )
    assert result["ratio"] > 0
    assert result["paired_ratio_median"] > 0
    assert result["update_freq"] == 1

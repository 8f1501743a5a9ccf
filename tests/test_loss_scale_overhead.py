"""The loss-scale overhead harness runs (at a tiny size) and reports every field."""

from benchmarks import loss_scale_overhead


def test_loss_scale_overhead_reports_both_variants_and_their_ratio():
    result = loss_scale_overhead.measure(
        rounds=2,
        steps_per_round=2,
        warmup_steps=1,
        batch_size=2,
        sequence_length=8,
        num_layers=1,
        d_model=8,
    )
    assert set(result) == {
        "benchmark",
        "model",
        "policy",
        "rounds",
        "steps_per_round",
        "median_step_seconds",
        "step_seconds",
        "ratio",
        "paired_ratio_median",
        "devices",
    }
    assert set(result["median_step_seconds"]) == {"stock", "mpt_keras"}
    assert all(len(times) == 2 for times in result["step_seconds"].values())
    assert result["ratio"] == (
        result["median_step_seconds"]["mpt_keras"] / result["median_step_seconds"]["stock"]
    )
    assert result["ratio"] > 0

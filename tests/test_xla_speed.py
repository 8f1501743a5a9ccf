"""The XLA speed harness runs (at a tiny size) and reports every field.

Two of the three precisions keep it fast: one that `auto` runs without XLA on
a CPU, one it runs with XLA.
"""

import tensorflow as tf

from benchmarks import xla_speed
from mpt_keras import xla


def test_xla_speed_reports_each_ratio_beside_the_auto_choice():
    result = xla_speed.measure(
        rounds=2,
        steps_per_round=1,
        warmup_steps=1,
        batch_size=2,
        image_batch_size=2,
        sequence_length=8,
        num_layers=1,
        d_model=8,
        precisions=("mixed_bfloat16", "mixed_float16"),
    )
    assert set(result) == {
        "benchmark",
        "models",
        "optimizer",
        "rounds",
        "steps_per_round",
        "results",
        "devices",
    }
    assert set(result["models"]) == set(result["results"]) == {"transformer_lm", "cnn"}
    for by_precision in result["results"].values():
        assert list(by_precision) == ["mixed_bfloat16", "mixed_float16"]
        for precision, row in by_precision.items():
            assert set(row) == {
                "median_step_seconds",
                "step_seconds",
                "ratio",
                "paired_ratio_median",
                "auto_jit_compile",
                "auto_reason",
                "auto_picks_faster",
            }
            medians = row["median_step_seconds"]
            assert set(medians) == set(row["step_seconds"]) == {"no_xla", "xla"}
            assert all(len(times) == 2 for times in row["step_seconds"].values())
            assert row["ratio"] == medians["xla"] / medians["no_xla"] > 0
            assert row["paired_ratio_median"] > 0
            auto = xla.resolve_jit_compile("auto", tf.distribute.get_strategy(), precision)
            assert (row["auto_jit_compile"], row["auto_reason"]) == auto
            assert row["auto_picks_faster"] is (auto[0] == (row["paired_ratio_median"] < 1))

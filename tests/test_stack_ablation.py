"""The stack ablation runs (at a tiny size) and reports every field."""

import pytest

from benchmarks import ablation_table, stack_ablation

RATIO_KEYS = {"ratio", "paired_ratio_median"}


@pytest.mark.parametrize("model", ["transformer_lm", "cnn"])
def test_stack_ablation_reports_every_variant_and_piece(model):
    result = stack_ablation.measure(
        model,
        "mixed_float16",
        jit_compile=False,
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
        "precision",
        "xla",
        "batch_size",
        "rounds",
        "steps_per_round",
        "median_step_seconds",
        "step_seconds",
        "vs_stock",
        "vs_previous",
        "machine",
    }
    variants = ["stock", "+train_step", "+loss_scale_optimizer", "+manifest", "+monitor"]
    assert list(result["median_step_seconds"]) == variants
    assert all(len(seconds) == 2 for seconds in result["step_seconds"].values())
    assert list(result["vs_stock"]) == list(result["vs_previous"]) == variants[1:]
    assert all(set(ratio) == RATIO_KEYS for ratio in result["vs_stock"].values())
    medians = result["median_step_seconds"]
    assert result["vs_previous"]["+manifest"]["ratio"] == (
        medians["+manifest"] / medians["+loss_scale_optimizer"]
    )
    assert result["vs_stock"]["+monitor"]["ratio"] == medians["+monitor"] / medians["stock"]
    table = stack_ablation.lines(result)
    assert table[0].startswith(f"{model}, mixed_float16, XLA off, batch 2:")
    assert [line.split()[0] for line in table[2:]] == variants
    # The result is a cell of the docs' table as it is.
    docs_table = ablation_table.markdown_table([result], "measured")
    assert docs_table[0] == (
        "| model | precision | XLA | stock ms | ours ms | ours / stock | `+train_step` | "
        "`+loss_scale_optimizer` | `+manifest` | `+monitor` |"
    )
    assert docs_table[2] == (
        f"| {model} | mixed_float16 | off | {medians['stock'] * 1e3:.2f} | "
        f"{medians['+monitor'] * 1e3:.2f} | "
        + " | ".join(
            f"{ratio['paired_ratio_median']:.3f}"
            for ratio in [result["vs_stock"]["+monitor"], *result["vs_previous"].values()]
        )
        + " |"
    )

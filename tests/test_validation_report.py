"""Tests of mpt_keras.validation.report: where the drift enters, and the report's table."""

from mpt_keras.validation.forward_parity import LayerParity
from mpt_keras.validation.report import ValidationReport
from mpt_keras.validation.thresholds import Check


def _row(path: str, jump: float) -> LayerParity:
    return LayerParity(path, "float16", 0.0, 0.0, jump, jump)


def _report(layers, **values) -> ValidationReport:
    return ValidationReport(
        **{
            "candidate": "mixed_bfloat16",
            "steps": 1,
            "layers": layers,
            "outputs": (),
            "baseline_losses": (),
            "candidate_losses": (),
            "baseline_metrics": {},
            "candidate_metrics": {},
            "skipped_steps": 0,
            "checks": (),
            **values,
        }
    )


def test_drift_enters_at_a_sublayer_not_at_the_block_whose_jump_sums_it():
    report = _report(
        (
            _row("embedding", 0.001),
            _row("block", 0.009),
            _row("block/attention", 0.002),
            _row("block/attention/query", 0.001),
            _row("block/mlp_gate", 0.006),
            _row("logits", 0.003),
        )
    )
    assert report.drift_entry() == "block/mlp_gate"


def test_the_table_aligns_layers_and_training_indented():
    report = _report(
        (_row("embedding", 0.001), _row("logits", 0.25)),
        steps=2,
        baseline_losses=(2.0, 1.0),
        candidate_losses=(2.0, 1.5),
        baseline_metrics={"val_accuracy": 0.5, "val_loss": 1.0},
        candidate_metrics={"val_accuracy": 0.25, "val_loss": 1.5},
        checks=(Check("final_loss_gap", 0.5, 0.1, "<="),),
    )
    assert report.table() == (
        "candidate mixed_bfloat16 vs float32: FAIL\n"
        "\n"
        "checks:\n"
        "  final_loss_gap: 0.5 (allowed <= 0.1) FAIL\n"
        "\n"
        "forward parity per layer (drift enters at logits):\n"
        "  path       compute  max_abs  mean_abs  relative  jump\n"
        "  embedding  float16  0        0         0.001     0.001\n"
        "  logits     float16  0        0         0.25      0.25\n"
        "\n"
        "training parity over 2 steps:\n"
        "                  loss first  loss last  val_loss  val_accuracy\n"
        "  float32         2.0000      1.0000     1.0000    0.5000\n"
        "  mixed_bfloat16  2.0000      1.5000     1.5000    0.2500\n"
        "candidate skipped steps: 0\n"
    )
    assert str(report) == report.table()  # print(report) shows it.
    assert report.to_dict()["drift_entry"] == "logits"

"""`validate`: a candidate precision against a float32 baseline, with pass/fail.

Training parity: each model trains `steps` steps side by side, then is evaluated. Forward
parity: every layer's output is compared, the candidate on float32's trained weights (its
float8 state kept); trained, as random weights give near-uniform logits whose argmax ties
rounding breaks (top-1 agreement 0.881, vs 0.983 after 50 steps, bundled float8 Transformer).

    final_loss_gap     |candidate - baseline| / baseline, mean loss of the last
                       max(1, steps // 5) steps
    metric_delta       baseline - candidate validation accuracy, with an accuracy metric
                       (the largest drop of any: each output's of a model of several)
    skipped_fraction   candidate steps skipped for non-finite gradients / steps

Each check compares one value with a `Thresholds` field; NaN fails.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import check_writable_dir, write_json_atomic, write_text_atomic
from mpt_keras.precision.names import PRECISIONS
from mpt_keras.runs.side_by_side import TrainingRun, resolve_side_by_side, train_steps
from mpt_keras.validation.forward_parity import ForwardParity, forward_parity, nan_as_inf
from mpt_keras.validation.loss_curves import plot_loss_curves, write_loss_curves
from mpt_keras.validation.report import ValidationReport
from mpt_keras.validation.thresholds import DEFAULT_STEPS, Check, Thresholds


def validate(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    candidate: str | os.PathLike,
    thresholds: Thresholds = Thresholds(),
    steps: int = DEFAULT_STEPS,
    *,
    data: tuple[Any, Any] | None = None,
    loss: Any = None,
    metrics: Sequence[Any] = (),
    config: TrainConfig | None = None,
) -> ValidationReport:
    """Compares `candidate` with float32 on the same weights and data.

    `model`: a run config; or a model factory or functional/Sequential model (cloned), with
    `data`, `loss`, `metrics`, `config` as `resolution.resolve` takes them. `candidate`: a
    precision or a manifest's path. `steps`: training-parity steps per model.

    Raises:
        UserInputError: For a bad candidate, config, manifest or dataset.
    """
    config, components, baseline_config = resolve_side_by_side(
        model, steps, data, loss, metrics, config, steps_name="steps", source="baseline"
    )
    candidate = os.fspath(candidate)
    candidate_config = _candidate_config(config, candidate, steps)
    run_data = components.data()

    baseline_run = train_steps(baseline_config, components, run_data)
    candidate_run = train_steps(candidate_config, components, run_data)
    parity = forward_parity(
        baseline_run.model,
        candidate_run.model,
        # Parity compares the models with each other, not labels.
        (
            keras.utils.unpack_x_y_sample_weight(batch)[0]
            for batch in run_data.eval_batches(config.data.eval_batch_size)
        ),
    )
    return ValidationReport(
        candidate=candidate,
        steps=steps,
        layers=parity.layers,
        outputs=parity.outputs,
        baseline_losses=baseline_run.losses,
        candidate_losses=candidate_run.losses,
        baseline_metrics=baseline_run.metrics,
        candidate_metrics=candidate_run.metrics,
        skipped_steps=candidate_run.skipped_steps,
        checks=_checks(parity, baseline_run, candidate_run, thresholds, steps),
        unreached=parity.unreached,
    )


def run_validation(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    candidate: str | os.PathLike,
    output: str | os.PathLike,
    thresholds: Thresholds = Thresholds(),
    steps: int = DEFAULT_STEPS,
    log_dir: str | os.PathLike | None = None,
    **objects: Any,
) -> ValidationReport:
    """`mpt-validate`: `validate`, then `output` (JSON), `<stem>.txt`, `<stem>.png` and
    TensorBoard loss curves under `log_dir` (default `<stem>_logs`). `UserInputError`: as
    `validate`, or `output` unwritable.
    """
    output = os.fspath(output)
    stem = os.path.splitext(output)[0]
    check_writable_dir(os.path.dirname(output) or ".", "--output directory", min_free_bytes=0)
    report = validate(model, candidate, thresholds, steps, **objects)
    write_json_atomic(output, report.to_dict())
    write_text_atomic(stem + ".txt", report.table())
    with open(stem + ".png", "wb") as file:
        file.write(plot_loss_curves(report.baseline_losses, report.candidate_losses))
    write_loss_curves(
        os.fspath(log_dir) if log_dir else stem + "_logs",
        report.baseline_losses,
        report.candidate_losses,
    )
    return report


def _candidate_config(config: TrainConfig, candidate: str, steps: int) -> TrainConfig:
    if candidate in PRECISIONS:
        return config.merged(
            {"precision": candidate, "manifest": None, "steps": steps}, source="candidate"
        )
    if not os.path.isfile(candidate):
        raise UserInputError(
            f"candidate {candidate!r}: neither a precision nor a manifest file. "
            f"Allowed: {', '.join(PRECISIONS)}, or the path of a manifest (JSON)"
        )
    return config.merged({"manifest": candidate, "steps": steps}, source="candidate")


def _checks(
    parity: ForwardParity,
    baseline: TrainingRun,
    candidate: TrainingRun,
    thresholds: Thresholds,
    steps: int,
) -> tuple[Check, ...]:
    window = max(1, steps // 5)
    baseline_final = float(np.mean(baseline.losses[-window:]))
    candidate_final = float(np.mean(candidate.losses[-window:]))
    outputs = parity.outputs
    # Each output's of a model of several (`val_digit_accuracy`), any accuracy's name.
    accuracies = [
        name
        for name in baseline.metrics
        if name.startswith("val_") and name.endswith("accuracy") and name in candidate.metrics
    ]
    return (
        Check(
            "output_relative_error",
            max((output.relative_error for output in outputs), default=math.nan),
            thresholds.output_rtol,
            "<=",
        ),
        Check(
            "top1_agreement",
            min((output.top1_agreement for output in outputs), default=math.nan),
            thresholds.min_top1_agreement,
            ">=",
        ),
        Check(
            "kl_divergence",
            max((output.kl_divergence for output in outputs), default=math.nan),
            thresholds.max_kl,
            "<=",
        ),
        *(
            [
                Check(
                    "metric_delta",
                    max(
                        (baseline.metrics[name] - candidate.metrics[name] for name in accuracies),
                        key=nan_as_inf,  # NaN fails, wherever it comes.
                    ),
                    thresholds.max_metric_delta,
                    "<=",
                )
            ]
            if accuracies
            else []
        ),
        Check(
            "final_loss_gap",
            abs(candidate_final - baseline_final) / baseline_final,
            thresholds.max_loss_gap,
            "<=",
        ),
        Check(
            "skipped_fraction",
            candidate.skipped_steps / steps,
            thresholds.max_skipped_fraction,
            "<=",
        ),
    )

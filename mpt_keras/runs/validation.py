"""`validate`: a candidate precision against a float32 baseline, with pass/fail.

Two comparisons of one model in float32 (the baseline) and in the candidate
precision, on the same data:

Training parity. Each model trains `steps` steps from the same float32 initial
weights with exactly the run that `mpt-train` assembles (`runs.assemble`: the
same model factory, manifest, optimizer, loss-scale settings, loss, metrics and
compiled step, bad-batch skip and XLA choice included) and the same batch
order, and is evaluated on the validation split.

Forward parity (`forward_parity`). Then the weights the baseline reached are
copied into the candidate, which keeps the state its own run gave it besides
(a float8 layer's scales and amax histories: what a float8 model computes
with). Both run the validation split with `training=False` and the output of
every layer the model's graph calls is compared, the layers of a backbone
called inside the model included (`llama_backbone/transformer_layer_0`), and
of every layer that a block or a subclassed model holds
(`llama_backbone/transformer_layer_0/self_attention/query`), so the report
shows where the drift enters, not only that it exists; the layers it could
not reach are listed with the reason (`ValidationReport.unreached`: a
sublayer its block did not call, as an attention's softmax beside a fused
kernel). Per layer: max and mean absolute error, relative error and the
error jump; per model output, also top-1 agreement and KL divergence. The
weights are trained ones because the logits of random weights are nearly
uniform: their argmax is a near tie that rounding breaks either way, so top-1
agreement there counts ties, not predictions. Measured on the bundled
Transformer with its float8 manifest: top-1 agreement 0.881 on the initial
weights and 0.983 after the 50 steps, KL divergence 0.0011 and 0.0002.

Training parity's figures:

    loss curves        the loss of each step, side by side
    final_loss_gap     |mean candidate - mean baseline| / mean baseline loss,
                       over the last max(1, steps // 5) steps
    metric_delta       baseline val_accuracy - candidate val_accuracy
                       (positive: the candidate is worse); only when the
                       run has an accuracy metric
    skipped_fraction   candidate steps skipped for non-finite gradients / steps

Each check compares one value with a `Thresholds` field; a NaN value fails.

The subject is a `TrainConfig`, or the user's own model factory (or a
functional model, cloned per precision) with `data` and `loss`:

    report = validate(
        lambda: keras.applications.MobileNetV2((32, 32, 3), alpha=0.35, weights=None, classes=10),
        "mixed_float16", data=(train, eval), loss="sparse_categorical_crossentropy",
        metrics=["accuracy"])
Dropout masks are drawn in each model's compute dtype, so with dropout the two
runs see different masks and their first losses differ by about 1%.

Example:

    config = mpt_keras.TrainConfig.from_json("configs/digits_cnn.json")
    report = validate(config, "mixed_float16", Thresholds(output_rtol=0.01))
    report.passed, [check.name for check in report.failed_checks()]

Why one module: training parity, the checks and the report come from two
runs built side by side (`runs`); the report's JSON, table, curves and
TensorBoard forms are how `mpt-validate` writes it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import json_safe, write_json_atomic, write_text_atomic
from mpt_keras.precision.names import PRECISIONS
from mpt_keras.runs import assembly as runs
from mpt_keras.validation.forward_parity import (
    LayerParity,
    UnreachedLayer,
    forward_parity,
    nan_as_inf,
)
from mpt_keras.validation.thresholds import BASELINE, DEFAULT_STEPS, Check, Thresholds

_CURVE_COLORS = {"baseline": (31, 119, 180), "candidate": (255, 127, 14)}


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """The comparison of a candidate with the float32 baseline.

    Attributes:
        candidate: The precision name or manifest path validated.
        steps: Training-parity steps.
        layers: Forward parity of each layer compared, in the order the model
            runs them (`forward_parity`).
        outputs: Forward parity of each model output, by output layer path.
        baseline_losses: The float32 loss of each training step.
        candidate_losses: The candidate's loss of each training step.
        baseline_metrics: Final validation metrics of the float32 model.
        candidate_metrics: Final validation metrics of the candidate.
        skipped_steps: Candidate steps skipped for non-finite gradients.
        checks: Each threshold's verdict.
        unreached: The layers forward parity did not compare, and why.

    Example:

        report = validate(config, "mixed_bfloat16")
        print(report.table())
    """

    candidate: str
    steps: int
    layers: tuple[LayerParity, ...]
    outputs: tuple[LayerParity, ...]
    baseline_losses: tuple[float, ...]
    candidate_losses: tuple[float, ...]
    baseline_metrics: Mapping[str, float]
    candidate_metrics: Mapping[str, float]
    skipped_steps: int
    checks: tuple[Check, ...]
    unreached: tuple[UnreachedLayer, ...] = ()

    @property
    def passed(self) -> bool:
        """Whether every check passed."""
        return all(check.passed for check in self.checks)

    def failed_checks(self) -> list[Check]:
        """The checks that failed, in report order."""
        return [check for check in self.checks if not check.passed]

    def drift_entry(self) -> str:
        """The path of the layer with the largest error jump ("" when none was compared).

        Among the rows that hold no other row: a block's jump sums the drift of
        its compared sublayers, so the block would stand for the sublayer that
        made it.
        """
        paths = [layer.path for layer in self.layers]
        leaves = [
            layer
            for layer in self.layers
            if not any(path.startswith(layer.path + "/") for path in paths)
        ]
        entry = max(leaves, key=lambda layer: nan_as_inf(layer.error_jump), default=None)
        return entry.path if entry else ""

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable values (NaN and inf as strings)."""
        values = dataclasses.asdict(self)
        values["checks"] = [
            {**dataclasses.asdict(check), "passed": check.passed} for check in self.checks
        ]
        values["passed"] = self.passed
        values["drift_entry"] = self.drift_entry()
        return json_safe(values)

    def table(self) -> str:
        """The report as aligned text: checks, per-layer parity, training."""
        lines = [f"candidate {self.candidate} vs {BASELINE}: {'PASS' if self.passed else 'FAIL'}"]
        lines += ["", "checks:"] + [f"  {check.describe()}" for check in self.checks]
        columns = ("path", "compute", "max_abs", "mean_abs", "relative", "jump")
        rows = [columns] + [
            (
                layer.path,
                layer.compute_dtype,
                *(
                    f"{value:.3g}"
                    for value in (
                        layer.max_abs_error,
                        layer.mean_abs_error,
                        layer.relative_error,
                        layer.error_jump,
                    )
                ),
            )
            for layer in self.layers
        ]
        lines += ["", f"forward parity per layer (drift enters at {self.drift_entry()}):"]
        lines += _aligned(rows)
        for output in self.outputs:
            lines.append(
                f"output {output.path}: top1_agreement {output.top1_agreement:.4f}, "
                f"kl_divergence {output.kl_divergence:.3g}"
            )
        if self.unreached:
            lines += ["", f"not compared ({len(self.unreached)}):"]
            lines += [f"  {layer.path}: {layer.reason}" for layer in self.unreached]
        lines += ["", f"training parity over {self.steps} steps:"]
        metric_names = sorted(self.baseline_metrics, key=lambda name: name != "val_loss")
        lines += _aligned(
            [("", "loss first", "loss last", *metric_names)]
            + [
                (
                    name,
                    f"{losses[0]:.4f}",
                    f"{losses[-1]:.4f}",
                    *(f"{metrics.get(metric, math.nan):.4f}" for metric in metric_names),
                )
                for name, losses, metrics in (
                    (BASELINE, self.baseline_losses, self.baseline_metrics),
                    (self.candidate, self.candidate_losses, self.candidate_metrics),
                )
            ]
        )
        lines.append(f"candidate skipped steps: {self.skipped_steps}")
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """What `train_steps` measured.

    Attributes:
        losses: The loss of each step.
        metrics: Validation metrics after the last step (`val_loss`,
            `val_accuracy`).
        skipped_steps: Steps skipped for non-finite gradients.
        model: The trained model.
    """

    losses: tuple[float, ...]
    metrics: dict[str, float]
    skipped_steps: int
    model: keras.Model


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

    Args:
        model: A run config, or a function returning a fresh model (called
            once per precision), or a functional/Sequential model (cloned).
        candidate: A precision (`mixed_float16`, `mixed_bfloat16`, `float32`,
            `auto`) or the path of a precision manifest (JSON).
        thresholds: What the candidate must meet.
        steps: Training-parity steps of each model.
        data: With a model: `(train, eval)`, `tf.data.Dataset`s of unbatched
            `(x, y)` or `(x, y, sample_weight)` elements, or `(x, y)` arrays.
        loss: With a model: its Keras loss.
        metrics: With a model: its Keras metrics.
        config: With a model: the settings (optimizer, batch size, seed, loss
            scale); default `TrainConfig()`'s. Its precision and manifest are
            replaced by the candidate's and by float32's, its `steps` by `steps`.

    Returns:
        The report; `report.passed` tells whether every threshold held.

    Raises:
        UserInputError: For a bad candidate, config, manifest or dataset.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserInputError(f"steps: must be an integer >= 1, received {steps!r}")
    config, components = runs.resolve(model, data=data, loss=loss, metrics=metrics, config=config)
    candidate = os.fspath(candidate)
    baseline_config = config.merged(
        {"precision": BASELINE, "manifest": None, "steps": steps}, source="baseline"
    )
    candidate_config = _candidate_config(config, candidate, steps)
    run_data = components.data()

    baseline_run = train_steps(baseline_config, components, run_data)
    candidate_run = train_steps(candidate_config, components, run_data)
    parity = forward_parity(
        baseline_run.model,
        candidate_run.model,
        # Parity compares the models with each other, not with labels.
        (
            keras.utils.unpack_x_y_sample_weight(batch)[0]
            for batch in run_data.eval_batches(config.data.eval_batch_size)
        ),
    )

    window = max(1, steps // 5)
    baseline_final = float(np.mean(baseline_run.losses[-window:]))
    candidate_final = float(np.mean(candidate_run.losses[-window:]))
    checks = (
        Check(
            "output_relative_error",
            max((output.relative_error for output in parity.outputs), default=math.nan),
            thresholds.output_rtol,
            "<=",
        ),
        Check(
            "top1_agreement",
            min((output.top1_agreement for output in parity.outputs), default=math.nan),
            thresholds.min_top1_agreement,
            ">=",
        ),
        Check(
            "kl_divergence",
            max((output.kl_divergence for output in parity.outputs), default=math.nan),
            thresholds.max_kl,
            "<=",
        ),
        *(
            [
                Check(
                    "metric_delta",
                    baseline_run.metrics["val_accuracy"] - candidate_run.metrics["val_accuracy"],
                    thresholds.max_metric_delta,
                    "<=",
                )
            ]
            if "val_accuracy" in baseline_run.metrics
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
            candidate_run.skipped_steps / steps,
            thresholds.max_skipped_fraction,
            "<=",
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
        checks=checks,
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
    """Runs `validate` and writes its report; what `mpt-validate` does.

    Writes `output` (the report JSON), `<output stem>.txt` (`report.table()`),
    `<output stem>.png` (the loss curves, see `plot_loss_curves`) and the loss curves
    as TensorBoard scalars `validation/loss` under `log_dir/float32` and
    `log_dir/candidate` (`log_dir` defaults to `<output stem>_logs`).

    Args:
        model: As `validate`: a run config, or a model of one's own.
        candidate: As `validate`.
        output: Path of the report JSON; its directory is created.
        thresholds: As `validate`.
        steps: As `validate`.
        log_dir: TensorBoard directory of the loss curves.
        **objects: With a model of one's own: `validate`'s `data`, `loss`,
            `metrics` and `config`.

    Returns:
        The report.

    Raises:
        UserInputError: As `validate`, or when `output` cannot be written.
    """
    output = os.fspath(output)
    stem = os.path.splitext(output)[0]
    try:
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    except OSError as error:
        raise UserInputError(f"--output {output}: cannot be created ({error.strerror})") from None
    report = validate(model, candidate, thresholds, steps, **objects)
    write_json_atomic(output, report.to_dict())
    write_text_atomic(stem + ".txt", report.table())
    with open(stem + ".png", "wb") as file:
        file.write(plot_loss_curves(report.baseline_losses, report.candidate_losses))
    _write_curves(os.fspath(log_dir) if log_dir else stem + "_logs", report)
    return report


def plot_loss_curves(
    baseline: Sequence[float], candidate: Sequence[float], width: int = 640, height: int = 400
) -> bytes:
    """The two loss curves as PNG bytes: float32 blue, candidate orange.

    Drawn with numpy and `tf.io.encode_png`, without a plotting library: a
    frame, the loss from the smallest (bottom) to the largest (top) finite
    loss of either curve, the steps from left to right. A non-finite loss is
    left out.
    """
    image = np.full((height, width, 3), 255, np.uint8)
    margin = 20
    image[margin, margin:-margin] = image[-margin, margin:-margin] = 160
    image[margin:-margin, margin] = image[margin:-margin, -margin] = 160
    finite = [value for value in (*baseline, *candidate) if math.isfinite(value)]
    bottom, top = min(finite, default=0.0), max(finite, default=1.0)
    span = (top - bottom) or 1.0
    for name, losses in (("baseline", baseline), ("candidate", candidate)):
        count = max(len(losses) - 1, 1)
        points = [
            (
                margin + (width - 2 * margin) * index / count,
                height - margin - (height - 2 * margin) * (value - bottom) / span,
            )
            for index, value in enumerate(losses)
            if math.isfinite(value)
        ]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            samples = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
            xs = np.linspace(x0, x1, samples).round().astype(int)
            ys = np.linspace(y0, y1, samples).round().astype(int)
            for offset in (-1, 0, 1):  # Three pixels thick, to be seen.
                image[np.clip(ys + offset, 0, height - 1), xs] = _CURVE_COLORS[name]
    return tf.io.encode_png(image).numpy()


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


def train_steps(
    config: TrainConfig, components: runs.Components, run_data: runs.RunData
) -> TrainingRun:
    """Trains `config.steps` steps of the run `mpt-train` assembles, writing nothing.

    The model, manifest, optimizer, loss-scale settings, loss, metrics, compiled
    step and batch order are `run_training`'s (`runs.assemble`), on the
    current strategy (none: one device).

    Args:
        config: The run config.
        components: Where the model, loss and metrics come from.
        run_data: The data to train and validate on.

    Returns:
        The loss of each step, the final validation metrics, the skipped
        steps and the trained model.
    """
    run = runs.assemble(config, components, run_data)
    train = run_data.train_batches(
        config.data.batch_size, config.seed, shuffle_buffer=config.data.shuffle_buffer
    )
    # One step per Keras epoch: the logged loss is then that step's, not a running mean.
    history = run.model.fit(train, epochs=config.steps, steps_per_epoch=1, shuffle=False, verbose=0)
    validation = run_data.eval_batches(config.data.eval_batch_size)
    metrics = run.model.evaluate(validation, return_dict=True, verbose=0)
    return TrainingRun(
        losses=tuple(float(loss) for loss in history.history["loss"]),
        metrics={f"val_{name}": float(value) for name, value in metrics.items()},
        skipped_steps=int(run.optimizer.skipped_steps),
        model=run.model,
    )


def _write_curves(log_dir: str, report: ValidationReport) -> None:
    for name, losses in (
        ("float32", report.baseline_losses),
        ("candidate", report.candidate_losses),
    ):
        writer = tf.summary.create_file_writer(os.path.join(log_dir, name))
        with writer.as_default():
            for step, loss in enumerate(losses, start=1):
                tf.summary.scalar("validation/loss", loss, step=step)
        writer.close()


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    ]

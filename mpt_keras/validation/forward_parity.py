"""Forward parity: each layer's output in a candidate precision against float32's, same weights.

Both run the same batches (`training=False`), each compared `call` wrapped to keep its
return: nothing is rebuilt around the model (nested backbones, dict inputs, shared layers,
masks run as in training). Rows (`parity_rows`) pair by position, by path where classes differ
(two builds may name `dense` and `dense_1`). Per row:

    max_abs_error      max |candidate - baseline|
    mean_abs_error     mean |candidate - baseline|
    relative_error     ||candidate - baseline||_2 / ||baseline||_2 over all batches
    error_jump         relative_error minus its parents' largest (inputs: 0): the
                       drift this layer adds

and per model output, as logits over the last axis:

    top1_agreement     fraction of predictions whose argmax agrees
    kl_divergence      mean KL(softmax(baseline) || softmax(candidate)), in nats
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.precision.float8 import is_float8, learned_weights
from mpt_keras.validation.parity_rows import ParityRows, Recorder, Row, UnreachedLayer

_NO_TWIN = "the candidate model has no layer at this path"


@dataclasses.dataclass(frozen=True)
class LayerParity:
    """One layer's (or model output's) forward parity (module doc)."""

    path: str
    compute_dtype: str  # `float8` for a float8 layer (`_compute`).
    max_abs_error: float
    mean_abs_error: float
    relative_error: float
    error_jump: float
    top1_agreement: float | None = None
    kl_divergence: float | None = None


@dataclasses.dataclass(frozen=True)
class ForwardParity:
    """What `forward_parity` compared (rows in call order, then outputs), and what not."""

    layers: tuple[LayerParity, ...]
    outputs: tuple[LayerParity, ...]
    unreached: tuple[UnreachedLayer, ...]


def forward_parity(
    baseline: keras.Model, candidate: keras.Model, batches: Iterable[Any]
) -> ForwardParity:
    """Compares `candidate` on `baseline`'s weights with `baseline`, layer by layer.

    `baseline`: float32; its weights are copied into `candidate`, which keeps its float8 state.
    `batches`: inputs only.
    """
    for variable, value in zip(learned_weights(candidate), baseline.get_weights(), strict=True):
        variable.assign(value)
    batches = iter(batches)
    first = next(batches, None)
    walk, twin = ParityRows(baseline, first), ParityRows(candidate, first)
    pairs, reasons = _paired(walk.rows, twin.rows)
    sums = {row: _ErrorSums() for row in pairs}
    expected, received = Recorder(baseline, walk), Recorder(candidate, twin)
    with (
        calls_wrapped(walk.watched.values(), expected.watching),
        calls_wrapped(twin.watched.values(), received.watching),
    ):
        for features in itertools.chain([] if first is None else [first], batches):
            mine, theirs = expected.run(features), received.run(features)
            for row, other in pairs.items():
                if row not in reasons and row in mine and other in theirs:
                    reason = sums[row].add(mine[row], theirs[other], walk.rows[row].output)
                    if reason:
                        reasons[row] = reason
    for row, errors in sums.items():
        if not errors.batches:
            reasons.setdefault(row, walk.unseen_reason(row))
    relative = {
        row: sums[row].relative_error()
        for row in expected.in_call_order(pairs)
        if row not in reasons
    }
    parities = {}
    for row in relative:
        upstream = [relative[parent] for parent in walk.rows[row].parents if parent in relative]
        parities[row] = sums[row].parity(
            walk.rows[row].path,
            _compute(twin.rows[pairs[row]].layer, sums[row].received_dtype),
            error_jump=relative[row] - max(upstream, default=0.0),
            logits=walk.rows[row].output,
        )
    return ForwardParity(
        layers=tuple(parities.values()),
        outputs=tuple(parities[row] for row in walk.outputs if row in parities),
        unreached=(
            *walk.unreached,
            *(UnreachedLayer(walk.rows[row].path, reasons[row]) for row in sorted(reasons)),
        ),
    )


def nan_as_inf(value: float) -> float:
    """Orders NaN above all, so the worst value wins a max()."""
    return math.inf if math.isnan(value) else value


class _ErrorSums:
    """Running sums of one row's errors over the batches."""

    def __init__(self):
        self.max_abs = self.abs_sum = self.squared_error = self.squared_baseline = 0.0
        self.kl_sum = 0.0
        self.count = self.batches = self.agreements = self.predictions = 0
        self.received_dtype = "float32"

    def add(self, expected: Any, received: Any, logits: bool) -> str | None:
        """Adds one batch; returns why the row cannot be compared, if so."""
        try:
            expected, received = _arrays(expected), _arrays(received)
        except Exception as error:  # A layer may return anything; the others are compared.
            return f"its output is not an array ({type(error).__name__}: {error})"
        shapes = ([array.shape for array in expected], [array.shape for array in received])
        if not expected:
            return "its call returned no tensor"
        if shapes[0] != shapes[1]:
            return f"its outputs differ in shape: float32 {shapes[0]}, candidate {shapes[1]}"
        self.received_dtype = str(received[0].dtype)
        self.batches += 1
        for base, other in zip(expected, received):
            self._add(base.astype(np.float64), other.astype(np.float64), logits)
        return None

    def _add(self, expected: np.ndarray, received: np.ndarray, logits: bool) -> None:
        difference = np.abs(received - expected)
        # max() of an array holding NaN is NaN, which fails every check.
        self.max_abs = max(self.max_abs, float(np.max(difference, initial=0.0)), key=nan_as_inf)
        self.abs_sum += float(np.sum(difference))
        self.squared_error += float(np.sum(difference**2))
        self.squared_baseline += float(np.sum(expected**2))
        self.count += difference.size
        if logits:
            self.agreements += int(np.sum(expected.argmax(-1) == received.argmax(-1)))
            self.predictions += expected[..., 0].size
            expected_log, received_log = _log_softmax(expected), _log_softmax(received)
            self.kl_sum += float(np.sum(np.exp(expected_log) * (expected_log - received_log)))

    def relative_error(self) -> float:
        if self.squared_baseline == 0:
            return 0.0 if self.squared_error == 0 else math.inf
        return math.sqrt(self.squared_error / self.squared_baseline)

    def parity(self, path: str, compute_dtype: str, error_jump: float, logits: bool) -> LayerParity:
        predictions = self.predictions or math.nan  # NaN fails a check, as a NaN error does.
        return LayerParity(
            path=path,
            compute_dtype=compute_dtype,
            max_abs_error=self.max_abs,
            mean_abs_error=self.abs_sum / max(self.count, 1),
            relative_error=self.relative_error(),
            error_jump=error_jump,
            top1_agreement=self.agreements / predictions if logits else None,
            kl_divergence=self.kl_sum / predictions if logits else None,
        )


def _compute(layer: Any, received_dtype: str) -> str:
    """What `layer` computes in: `float8` for a float8 layer (its matmul; it returns its
    policy's compute dtype), its policy's compute dtype, or for an operation, which has no
    policy, the dtype it returned."""
    if is_float8(layer):
        return "float8"
    policy = getattr(layer, "dtype_policy", None)
    return policy.compute_dtype if policy is not None else received_dtype


def _paired(rows: list[Row], twins: list[Row]) -> tuple[dict[int, int], dict[int, str]]:
    """`{row: candidate's row}`, and `{row: why}` for rows without a twin."""
    if [type(row.layer) for row in rows] == [type(row.layer) for row in twins]:
        return {index: index for index in range(len(rows))}, {}
    by_path = {row.path: index for index, row in enumerate(twins)}
    pairs = {index: by_path[row.path] for index, row in enumerate(rows) if row.path in by_path}
    return pairs, {index: _NO_TWIN for index in range(len(rows)) if index not in pairs}


def _arrays(value: Any) -> list[np.ndarray]:
    return [
        np.asarray(keras.ops.convert_to_numpy(tensor))
        for tensor in keras.tree.flatten(value)
        if keras.ops.is_tensor(tensor)
    ]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

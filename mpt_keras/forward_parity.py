"""Forward parity: each layer's output in a candidate precision against float32's, same weights.

What `validate` compares after training parity, on any model the run trains.
Both models run the same batches with `training=False`, the `call` of each
compared layer wrapped (`layer_calls.calls_wrapped`) to keep what it returned.
Nothing is rebuilt around the model: a backbone inside the user's own model,
Sequential models, dict inputs, shared layers and masks run as in training.

Rows, in the order the model runs them, by path (`layer_paths`' paths):
every layer a functional or Sequential model's graph calls, descending into a
functional or Sequential model called in it (`llama_backbone/transformer_layer_0`;
its outputs are its last layers' rows). A layer called twice in one graph is
compared at the call that makes an output of its model, else at its first: a
keras_hub CausalLM's tied embedding is the logits at `token_embedding` and the
token lookup at `gpt2_backbone/token_embedding`. A layer holding layers (a
transformer block) is one row, and so is a model whose call is Python code
(subclassed, or a functional subclass with a `call` of its own). A model
output an operation makes (`keras.ops.softmax(x)`) is a row read from what the
model returned. Two builds of one factory may name layers differently
(`dense`, `dense_1`): rows pair by position, by path where classes differ.

Unreached (with the reason): the layers inside a model whose call is Python
code; a layer a model holds that its graph never calls; a call not seen when
the model ran; outputs not arrays of one shape in both models; no twin.

Figures, per row and per model output:

    max_abs_error      max |candidate - baseline|
    mean_abs_error     mean |candidate - baseline|
    relative_error     ||candidate - baseline||_2 / ||baseline||_2 over all batches
    error_jump         relative_error minus the largest relative_error of the
                       rows the call's inputs come from (through operations and
                       nested models; 0 for the model inputs): the drift this
                       layer adds; the largest jump is where the drift enters

and for the outputs, taken as logits over the last axis:

    top1_agreement     fraction of predictions whose argmax agrees
    kl_divergence      mean KL(softmax(baseline) || softmax(candidate)), in nats

Example:

    parity = forward_parity(float32_model, mixed_model, [x_batch])
    [row.path for row in parity.layers], parity.unreached
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from mpt_keras import keras_compat as compat
from mpt_keras.layer_calls import calls_wrapped
from mpt_keras.layer_paths import iter_layers
from mpt_keras.precision.float8 import learned_weights

# A call: (id(layer), its call number) of each watched call from the model down to it.
_Frame = tuple[tuple[int, int], ...]

_PYTHON_CALL = (
    "inside {model!r}, a model whose call is Python code, not a graph of layer calls: "
    "compared as part of {model!r}"
)
_NOT_IN_GRAPH = "held by {model!r} but not called by its graph"
_NOT_SEEN = "its call was not seen when the model ran"
_NO_TWIN = "the candidate model has no layer at this path"


@dataclasses.dataclass(frozen=True)
class LayerParity:
    """Forward parity of one layer's (or model output's) output; see the module doc."""

    path: str
    compute_dtype: str
    max_abs_error: float
    mean_abs_error: float
    relative_error: float
    error_jump: float
    top1_agreement: float | None = None
    kl_divergence: float | None = None


@dataclasses.dataclass(frozen=True)
class UnreachedLayer:
    """A layer forward parity did not compare, and why (see the module doc)."""

    path: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ForwardParity:
    """What `forward_parity` compared, and what it could not.

    Attributes:
        layers: Each row, in the order the model runs them.
        outputs: The row of each model output, in the model's order.
        unreached: The layers not compared, with the reason.
    """

    layers: tuple[LayerParity, ...]
    outputs: tuple[LayerParity, ...]
    unreached: tuple[UnreachedLayer, ...]


def forward_parity(
    baseline: keras.Model, candidate: keras.Model, batches: Iterable[Any]
) -> ForwardParity:
    """Compares `candidate` on `baseline`'s weights with `baseline`, layer by layer.

    Args:
        baseline: The float32 model; its weights are copied into `candidate`,
            which keeps any float8 state of its own (what it computes with).
        candidate: The same model in the candidate precision.
        batches: The model's inputs, batch by batch (no labels).

    Returns:
        The rows, the outputs' rows and the unreached layers.
    """
    for variable, value in zip(learned_weights(candidate), baseline.get_weights(), strict=True):
        variable.assign(value)
    walk, twin = _Walk(baseline), _Walk(candidate)
    pairs, reasons = _paired(walk.rows, twin.rows)
    sums = {row: _ErrorSums() for row in pairs}
    expected, received = _Recorder(baseline, walk), _Recorder(candidate, twin)
    with (
        calls_wrapped(walk.watched.values(), expected.watching),
        calls_wrapped(twin.watched.values(), received.watching),
    ):
        for features in batches:
            mine, theirs = expected.run(features), received.run(features)
            for row, other in pairs.items():
                if row not in reasons and row in mine and other in theirs:
                    reason = sums[row].add(mine[row], theirs[other], walk.rows[row].output)
                    if reason:
                        reasons[row] = reason
    for row, errors in sums.items():
        if not errors.batches:
            reasons.setdefault(row, _NOT_SEEN)
    relative = {row: sums[row].relative_error() for row in pairs if row not in reasons}
    parities = {}
    for row in relative:
        upstream = [relative[parent] for parent in walk.rows[row].parents if parent in relative]
        # An operation has no policy: the dtype it returned.
        policy = getattr(twin.rows[pairs[row]].layer, "dtype_policy", None)
        parities[row] = sums[row].parity(
            walk.rows[row].path,
            policy.compute_dtype if policy is not None else sums[row].received_dtype,
            error_jump=relative[row] - max(upstream, default=0.0),
            logits=walk.rows[row].output,
        )
    return ForwardParity(
        layers=tuple(parities.values()),
        outputs=tuple(parities[row] for row in walk.outputs if row in parities),
        unreached=(
            *walk.unreached,
            *(UnreachedLayer(walk.rows[row].path, reason) for row, reason in reasons.items()),
        ),
    )


def nan_as_inf(value: float) -> float:
    """Orders NaN above everything, so the worst value wins a max()."""
    return math.inf if math.isnan(value) else value


@dataclasses.dataclass(frozen=True)
class _Graph:
    """One call of a model whose call runs its graph: where its rows' inputs come from."""

    model: keras.Model
    frame: _Frame
    prefix: str
    caller: _Graph | None = None  # The graph that called it, and its node there.
    node: Any = None


@dataclasses.dataclass
class _Row:
    """One compared call: a layer's, or a model output read from what the model returned."""

    path: str
    layer: Any
    frame: _Frame | None  # None: read from what the model returned.
    returned: int | None = None  # With no frame: that model output; None: all of them.
    node: Any = None  # Its call in `graph` (None for a model compared whole).
    graph: _Graph | None = None
    parents: tuple[int, ...] = ()
    output: bool = False


class _Walk:
    """The rows of one model, the layers whose calls are watched, and the unreached layers."""

    def __init__(self, model: keras.Model):
        self.rows: list[_Row] = []
        self.outputs: list[int] = []
        self.unreached: list[UnreachedLayer] = []
        self.watched: dict[int, keras.layers.Layer] = {}
        self._row_at: dict[tuple[_Frame, int], int] = {}
        self._graph_at: dict[tuple[_Frame, int], _Graph] = {}
        if compat.graph_calls(model) is None:
            self.rows.append(_Row(model.name, model, None, output=True))
            self.outputs.append(0)
            self._unreach_inside(model, model.name, prefix="")
            return
        top = _Graph(model, (), "")
        self._walk(top)
        for index, tensor in enumerate(model.outputs):
            row = self._output_row(tensor, top, index)
            self.rows[row].output = True
            self.outputs.append(row)
        for index, row in enumerate(self.rows):
            sources = self._all_sources(row.node.input_tensors, row.graph)
            row.parents = tuple(sorted(sources - {index}))

    def _walk(self, graph: _Graph) -> None:
        nodes = compat.graph_calls(graph.model)
        calls: dict[int, list[Any]] = {}
        for node in nodes:
            calls.setdefault(id(node.operation), []).append(node)
        for node in nodes:
            layer, own = node.operation, calls[id(node.operation)]
            if not isinstance(layer, keras.layers.Layer) or node is not _compared(own, graph):
                continue
            frame = (*graph.frame, (id(layer), own.index(node)))
            path = graph.prefix + layer.name
            self.watched[id(layer)] = layer
            if compat.graph_calls(layer) is not None:
                inner = _Graph(layer, frame, path + "/", graph, node)
                self._graph_at[graph.frame, id(layer)] = inner
                self._walk(inner)
                continue
            self._row_at[graph.frame, id(layer)] = len(self.rows)
            self.rows.append(_Row(path, layer, frame, node=node, graph=graph))
            if isinstance(layer, keras.Model):
                self._unreach_inside(layer, path, prefix=path + "/")
        for path, layer in _children(graph.model, graph.prefix):
            if id(layer) not in calls:
                self.unreached.append(
                    UnreachedLayer(path, _NOT_IN_GRAPH.format(model=graph.model.name))
                )

    def _unreach_inside(self, model: keras.Model, path: str, prefix: str) -> None:
        self.unreached += [
            UnreachedLayer(child, _PYTHON_CALL.format(model=path))
            for child, _ in _children(model, prefix)
        ]

    def _output_row(self, tensor: Any, graph: _Graph, index: int) -> int:
        """The row of model output `index`, made by `tensor` of `graph`; a new one if none is."""
        layer, node = compat.producing_layer(tensor), compat.producing_node(tensor)
        inner = self._graph_at.get((graph.frame, id(layer)))
        if inner is not None and inner.node is node:
            position = _position(tensor, node.output_tensors)
            return self._output_row(inner.model.outputs[position], inner, index)
        row = self._row_at.get((graph.frame, id(layer)))
        if row is not None and self.rows[row].node is node and len(node.output_tensors) == 1:
            return row
        # Made by an operation, by another call of a layer, or with other outputs beside.
        path = graph.prefix + layer.name
        if any(other.path == path for other in self.rows):
            path += f"/output_{index}"
        self.rows.append(_Row(path, layer, None, returned=index, node=node, graph=graph))
        return len(self.rows) - 1

    def _all_sources(self, tensors: Iterable[Any], graph: _Graph) -> frozenset[int]:
        """The rows whose outputs `tensors` of `graph` are, or are computed from by operations."""
        found, seen = set(), set()
        pending = [(tensor, graph) for tensor in tensors]
        while pending:  # Not recursive: a chain of operations may be long.
            tensor, graph = pending.pop()
            if (id(tensor), graph.frame) in seen:
                continue
            seen.add((id(tensor), graph.frame))
            layer, node = compat.producing_layer(tensor), compat.producing_node(tensor)
            row = self._row_at.get((graph.frame, id(layer)))
            inner = self._graph_at.get((graph.frame, id(layer)))
            if isinstance(layer, keras.layers.InputLayer):
                pending += self._fed(tensor, graph)
            elif row is not None:
                found.add(row)
            elif inner is not None:
                position = _position(tensor, node.output_tensors)
                pending.append((inner.model.outputs[position], inner))
            else:  # An operation between layers: where its inputs come from.
                pending += [(given, graph) for given in node.input_tensors]
        return frozenset(found)

    @staticmethod
    def _fed(tensor: Any, graph: _Graph) -> list[tuple[Any, _Graph]]:
        """What feeds input `tensor` of a nested model's call (nothing for the model's own)."""
        if graph.caller is None:
            return []
        given, inputs = graph.node.input_tensors, graph.model.inputs
        if len(given) == len(inputs) and any(other is tensor for other in inputs):
            given = [given[_position(tensor, inputs)]]
        return [(other, graph.caller) for other in given]


class _Recorder:
    """Runs a model with its watched calls wrapped; keeps what each row's call returned."""

    def __init__(self, model: keras.Model, walk: _Walk):
        self._model, self._walk = model, walk
        self._rows = {row.frame: index for index, row in enumerate(walk.rows) if row.frame}
        self._frames: list[_Frame] = [()]
        self._counts: list[dict[int, int]] = [{}]
        self._returned: dict[int, Any] = {}

    def run(self, features: Any) -> dict[int, Any]:
        """`{row: what its call returned}` for one batch."""
        self._returned = {}
        outputs = self._model(features, training=False)
        flat = keras.tree.flatten(outputs)
        for index, row in enumerate(self._walk.rows):
            if row.frame is None:
                self._returned[index] = outputs if row.returned is None else flat[row.returned]
        return self._returned

    def watching(self, layer: keras.layers.Layer, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, numbered per caller, keeping its outputs when it is a row's call."""

        @functools.wraps(call)
        def watched(*args, **kwargs):
            counts = self._counts[-1]
            number = counts[id(layer)] = counts.get(id(layer), -1) + 1
            frame = (*self._frames[-1], (id(layer), number))
            self._frames.append(frame)
            self._counts.append({})
            try:
                outputs = call(*args, **kwargs)
            finally:
                self._frames.pop()
                self._counts.pop()
            if frame in self._rows:
                self._returned[self._rows[frame]] = outputs
            return outputs

        return watched


class _ErrorSums:
    """Running sums of one row's errors over the batches."""

    def __init__(self):
        self.max_abs = self.abs_sum = self.squared_error = self.squared_baseline = 0.0
        self.kl_sum = 0.0
        self.count = self.batches = self.agreements = self.predictions = 0
        self.received_dtype = "float32"

    def add(self, expected: Any, received: Any, logits: bool) -> str | None:
        """Adds one batch; returns why the row cannot be compared, if it cannot."""
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


def _paired(rows: list[_Row], twins: list[_Row]) -> tuple[dict[int, int], dict[int, str]]:
    """`{row: the candidate's row}` by position (by path where the layer classes differ),
    and `{row: why}` for the rows without a twin."""
    if [type(row.layer) for row in rows] == [type(row.layer) for row in twins]:
        return {index: index for index in range(len(rows))}, {}
    by_path = {row.path: index for index, row in enumerate(twins)}
    pairs = {index: by_path[row.path] for index, row in enumerate(rows) if row.path in by_path}
    return pairs, {index: _NO_TWIN for index in range(len(rows)) if index not in pairs}


def _compared(nodes: list[Any], graph: _Graph) -> Any:
    """Of a layer's calls in `graph`, the first making an output of its model, else the first."""
    outputs = {id(tensor) for tensor in graph.model.outputs}
    made = [node for node in nodes if any(id(x) in outputs for x in node.output_tensors)]
    return (made or nodes)[0]


def _children(model: keras.Model, prefix: str) -> list[tuple[str, Any]]:
    """`(path, layer)` of the layers `model` holds directly."""
    depth = prefix.count("/")
    return [(path, layer) for path, layer in iter_layers(model, prefix) if path.count("/") == depth]


def _position(tensor: Any, tensors: list[Any]) -> int:
    # Symbolic tensors overload ==: find by identity.
    return next(index for index, other in enumerate(tensors) if other is tensor)


def _arrays(value: Any) -> list[np.ndarray]:
    return [
        np.asarray(keras.ops.convert_to_numpy(tensor))
        for tensor in keras.tree.flatten(value)
        if keras.ops.is_tensor(tensor)
    ]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

"""Parity rows: the calls forward parity compares (by path, in call order), and what feeds each.

    graph calls  every layer a functional or Sequential graph calls, nested graphs
                 included; a layer called twice at the call making a model output,
                 else its first (a CausalLM's tied embedding: logits, token lookup).
    sublayers    every layer, at any depth, held by a layer whose call is Python
                 (a block, a subclassed model), at its first call inside its
                 holder's compared call; the holder's row comes just before.
    outputs      a model output an operation makes, read from the model's return;
                 a subclassed model's whole return, or, where it returns several
                 tensors, each (`two_heads/digit`, by its key in the return).

Parents (the error jump's base): in a graph, the rows its inputs come from through operations
and nested models. Inside a holder (as float32 runs): the row returning each floating tensor a
call takes (by identity); one an operation made stands for every row it may come from, so a
jump is at worst understated, never overstated.

Unreached (with reasons): not called by its graph model; not called inside its holder's call
(an attention's softmax beside a fused kernel); not seen when the model ran.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.keras_bridge.layer_paths import iter_layers

# (id(layer), call number) of each watched call from the model down to a graph call.
Frame = tuple[tuple[int, int], ...]

_NOT_IN_GRAPH = "held by {model!r} but not called by its graph"
_NOT_SEEN = "its call was not seen when the model ran"
_NOT_CALLED = "not called inside {holder!r}, which holds it, when the model ran"


@dataclasses.dataclass(frozen=True)
class UnreachedLayer:
    """A layer forward parity did not compare, and why."""

    path: str
    reason: str


@dataclasses.dataclass(frozen=True)
class _Graph:
    """One call of a graph model (where its rows' inputs come from)."""

    model: keras.Model
    frame: Frame
    prefix: str
    caller: _Graph | None = None  # The calling graph, and the node there.
    node: Any = None


@dataclasses.dataclass
class Row:
    """One compared call: a graph's, a sublayer's, or a model output the model returned.

    `frame`: a graph call's place in the run (else None); `holder`: a sublayer's holder row;
    `returned`: the model output's index a row reads (None: all); `node`: a graph call's
    node, or the one making a model output.
    """

    path: str
    layer: Any
    frame: Frame | None = None
    holder: int | None = None
    returned: int | None = None
    node: Any = None
    graph: _Graph | None = None
    parents: tuple[int, ...] = ()
    output: bool = False


class ParityRows:
    """A model's rows, the layers whose calls are watched, and the unreached layers.

    Sublayer parents are set as `Recorder` runs the model, the others' here. `rows`: graph
    order, each holder's sublayers after it, depth first; `outputs`: each model output's row;
    `watched`: `{id(layer): layer}`; `model_row`: the model's row if its call is Python.
    """

    def __init__(self, model: keras.Model, example: Any = None):
        """`example`: inputs to learn, by a call, how many tensors a subclassed model returns
        (without one, its whole return is one output row)."""
        self.rows: list[Row] = []
        self.outputs: list[int] = []
        self.unreached: list[UnreachedLayer] = []
        self.watched: dict[int, keras.layers.Layer] = {}
        self.model_row: int | None = None
        self._row_at: dict[tuple[Frame, int], int] = {}
        self._graph_at: dict[tuple[Frame, int], _Graph] = {}
        if compat.graph_calls(model) is None:
            self.model_row = 0
            self.rows.append(Row(model.name, model))
            self._add_sublayers(0, prefix="")
            self._returned_rows(model, example)
            return
        top = _Graph(model, (), "")
        self._walk(top)
        for index, tensor in enumerate(model.outputs):
            row = self._output_row(tensor, top, index)
            self.rows[row].output = True
            self.outputs.append(row)
        for index, row in enumerate(self.rows):
            if row.holder is None:
                sources = self._all_sources(row.node.input_tensors, row.graph)
                row.parents = tuple(sorted(sources - {index}))

    def _returned_rows(self, model: keras.Model, example: Any) -> None:
        """A subclassed model's output rows: its row if it returns one tensor, else one per
        tensor, named by its place in the return. Such a row has no layer: it computes in the
        dtype it returns (a head kept in float32 under a bfloat16 model)."""
        places = []
        if example is not None:
            returned = model(example, training=False)  # One batch: a trace may not do.
            places = [place for place, _ in keras.tree.flatten_with_path(returned)]
        if len(places) < 2:
            self.rows[0].output = True
            self.outputs.append(0)
            return
        for index, place in enumerate(places):
            path = "/".join([model.name, *(str(key) for key in place)])
            self.outputs.append(len(self.rows))
            self.rows.append(Row(path, None, returned=index, output=True))

    def unseen_reason(self, row: int) -> str:
        """Why row `row`, its call not seen, was not compared."""
        holder = self.rows[row].holder
        if holder is None:
            return _NOT_SEEN
        return _NOT_CALLED.format(holder=self.rows[holder].path)

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
            self.rows.append(Row(path, layer, frame, node=node, graph=graph))
            self._add_sublayers(len(self.rows) - 1, prefix=path + "/")
        for path, layer in _children(graph.model, graph.prefix):
            if id(layer) not in calls:
                self.unreached.append(
                    UnreachedLayer(path, _NOT_IN_GRAPH.format(model=graph.model.name))
                )

    def _add_sublayers(self, holder: int, prefix: str) -> None:
        """A row for each layer `holder`'s layer holds, at its first path."""
        holders = {prefix: holder}  # By the path of a holder's sublayers: "block/" or "".
        seen = {id(self.rows[holder].layer)}
        for path, layer in iter_layers(self.rows[holder].layer, prefix):
            if id(layer) in seen:  # Its sublayers were seen with it.
                continue
            seen.add(id(layer))
            self.watched[id(layer)] = layer
            holders[path + "/"] = len(self.rows)
            self.rows.append(Row(path, layer, holder=holders[path[: path.rfind("/") + 1]]))

    def _output_row(self, tensor: Any, graph: _Graph, index: int) -> int:
        """Model output `index`'s row, made by `tensor` of `graph` (new if none is)."""
        layer, node = compat.producing_layer(tensor), compat.producing_node(tensor)
        inner = self._graph_at.get((graph.frame, id(layer)))
        if inner is not None and inner.node is node:
            position = _position(tensor, node.output_tensors)
            return self._output_row(inner.model.outputs[position], inner, index)
        row = self._row_at.get((graph.frame, id(layer)))
        if row is not None and self.rows[row].node is node and len(node.output_tensors) == 1:
            return row
        # Made by an operation, another call of a layer, or beside other outputs.
        path = graph.prefix + layer.name
        if any(other.path == path for other in self.rows):
            path += f"/output_{index}"
        self.rows.append(Row(path, layer, returned=index, node=node, graph=graph))
        return len(self.rows) - 1

    def _all_sources(self, tensors: Iterable[Any], graph: _Graph) -> frozenset[int]:
        """The rows whose outputs `tensors` of `graph` are or derive from by operations."""
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


class Recorder:
    """Runs a model with its watched calls wrapped, keeping each row's return; sets sublayer
    rows' parents at their first call and numbers rows by call start (`in_call_order`)."""

    def __init__(self, model: keras.Model, rows: ParityRows):
        self._model, self._rows = model, rows
        self._graph_rows = {row.frame: index for index, row in enumerate(rows.rows) if row.frame}
        self._sublayer_rows: dict[int, list[int]] = {}
        for index, row in enumerate(rows.rows):
            if row.holder is not None:
                self._sublayer_rows.setdefault(id(row.layer), []).append(index)
        self._started: dict[int, int] = {}
        self._frames: list[Frame] = [()]
        self._counts: list[dict[int, int]] = [{}]
        self._running: set[int] = set()
        self._returned: dict[int, Any] = {}
        self._made: dict[int, tuple[int, Any]] = {}
        self._inside: dict[int, list[int]] = {}  # The rows returned so far in a running call.

    def run(self, features: Any) -> dict[int, Any]:
        """`{row: what its call returned}` for one batch."""
        self._returned, self._made, self._inside = {}, {}, {}
        model_row = self._rows.model_row
        self._running = set() if model_row is None else {model_row}
        try:
            outputs = self._model(features, training=False)
            flat = keras.tree.flatten(outputs)
            if model_row is not None and model_row not in self._started:
                self._started[model_row] = -1  # Before every call in it.
                for row in self._rows.outputs:
                    returned = self._rows.rows[row].returned
                    given = outputs if returned is None else flat[returned]
                    self._rows.rows[row].parents = self._sources(given, model_row)
                self._rows.rows[model_row].parents = self._sources(outputs, model_row)
        finally:
            self._made = {}  # It holds every row's tensors: not past the batch.
        for index, row in enumerate(self._rows.rows):
            if row.frame is None and row.holder is None:
                self._returned[index] = outputs if row.returned is None else flat[row.returned]
        return self._returned

    def in_call_order(self, rows: Iterable[int]) -> list[int]:
        """`rows` in call order, each holder's sublayers after it."""

        def position(row: int) -> tuple[int, int]:
            outermost = row
            while self._rows.rows[outermost].holder is not None:
                outermost = self._rows.rows[outermost].holder
            return outermost, self._started.get(row, -1) if outermost != row else -1

        return sorted(rows, key=position)

    def watching(self, layer: keras.layers.Layer, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, numbered per caller, keeping its outputs if a row's."""

        @functools.wraps(call)
        def watched(*args, **kwargs):
            counts = self._counts[-1]
            number = counts[id(layer)] = counts.get(id(layer), -1) + 1
            frame = (*self._frames[-1], (id(layer), number))
            row = self._graph_rows.get(frame)
            if row is None:
                row = self._sublayer_row(layer, (args, kwargs))
            self._frames.append(frame)
            self._counts.append({})
            if row is not None:
                self._running.add(row)
            try:
                outputs = call(*args, **kwargs)
            finally:
                self._frames.pop()
                self._counts.pop()
                self._running.discard(row)
            if row is not None:
                self._returned[row] = outputs
                for tensor in keras.tree.flatten(outputs):
                    self._made[id(tensor)] = (row, tensor)
                for running in self._running:
                    self._inside.setdefault(running, []).append(row)
            return outputs

        return watched

    def _sublayer_row(self, layer: keras.layers.Layer, given: Any) -> int | None:
        """The sublayer row this call of `layer` is (first in its holder's call), or None."""
        for row in self._sublayer_rows.get(id(layer), ()):
            holder = self._rows.rows[row].holder
            if holder in self._running and row not in self._returned and row not in self._running:
                if row not in self._started:
                    self._started[row] = len(self._started)
                    self._rows.rows[row].parents = self._sources(given, holder)
                return row
        return None

    def _sources(self, given: Any, holder: int) -> tuple[int, ...]:
        """The rows the floating tensors of `given`, inside row `holder`'s call, come from."""
        found = set()
        for tensor in keras.tree.flatten(given):
            if not keras.ops.is_tensor(tensor) or not keras.backend.is_float_dtype(tensor.dtype):
                continue
            made = self._made.get(id(tensor))
            if made is not None and made[1] is tensor:
                found.add(made[0])
            else:  # Made by an operation: of what may have fed it.
                found.update(self._rows.rows[holder].parents)
                found.update(self._inside.get(holder, ()))
        return tuple(sorted(found))


def _compared(nodes: list[Any], graph: _Graph) -> Any:
    """A layer's call in `graph` making a model output, else its first."""
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

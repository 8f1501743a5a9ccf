"""Touches of Keras' layer internals: dtype policy, the float8 call, sublayers, functional
graph, call records."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from typing import Any

import keras


def replace_dtype_policy(layer: keras.layers.Layer, policy: keras.DTypePolicy) -> None:
    """Gives `layer` the policy `policy` itself; the public setter writes into a held map."""
    layer._dtype_policy = policy


def replace_float8_call(layer: keras.layers.Layer, call: Any) -> None:
    """Makes the float8 `layer` run `call(inputs, training=...)`: Keras' `quantized_call`
    runs `_float8_call`, on the instance first."""
    layer._float8_call = call


def direct_sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers `layer` tracks directly, in order; Keras lists them only for models."""
    return layer._flatten_layers(include_self=False, recursive=False)


def producing_layer(tensor: keras.KerasTensor) -> keras.layers.Layer:
    """The layer (or operation) whose call made the symbolic `tensor`."""
    return tensor._keras_history.operation


def producing_node(tensor: keras.KerasTensor) -> Any:
    """The call (node) that made the symbolic `tensor`; its `input_tensors` are what it took."""
    history = tensor._keras_history
    return history.operation._inbound_nodes[history.node_index]


@contextlib.contextmanager
def call_records_restored(layers: Iterable[keras.layers.Layer]) -> Iterator[None]:
    """Puts back, on exit (even on error), what calls in the block record on each layer:
    `_called` (read by Keras' export), `_parent_path` (later variables' scope), `_losses`."""
    kept = [(layer, layer._called, layer._parent_path, list(layer._losses)) for layer in layers]
    try:
        yield
    finally:
        for layer, called, parent_path, losses in kept:
            layer._called = called
            layer._parent_path = parent_path
            layer._losses[:] = losses


def runs_graph(layer: keras.layers.Layer) -> bool:
    """Whether `layer` is a functional or Sequential model whose `call` is Keras' (it runs
    its graph of layers, built or not), not a layer's or subclass's own code."""
    if isinstance(layer, keras.Sequential):
        return type(layer).call is keras.Sequential.call
    functional = importlib.import_module("keras.src.models.functional").Functional
    return isinstance(layer, functional) and type(layer).call is functional.call


def graph_calls(model: keras.Model) -> list[Any] | None:
    """The calls (nodes) `model`'s own `call` runs from its graph, in order (deepest first),
    inputs left out; None where it runs none (a layer, a subclassed model or one with its own
    `call`, an unbuilt Sequential)."""
    if not runs_graph(model):
        return None
    graph = model._functional if isinstance(model, keras.Sequential) else model
    if graph is None:
        return None
    by_depth = graph._nodes_by_depth
    return [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if node.operation is not None and not node.is_input
    ]

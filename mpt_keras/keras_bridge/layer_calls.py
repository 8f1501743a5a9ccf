"""Layer calls watched for the length of a block: how the toolkit watches a model run.

Two ways, for two needs. `calls_wrapped` wraps the `call` of chosen layers,
which sees the inputs after Keras cast them to the layer's compute dtype.
`calls_before_cast` wraps `Layer.__call__` for every layer, which sees the
inputs as the caller gave them: a float32 value too large for the float16
layer it feeds is still finite there (diagnosis needs that).

The precision report records the dtypes each layer returns, calibration each
measured layer's inputs and outputs, and its float8 part each Dense's inputs
and pre-activation outputs: each wraps the `call` of the layers it watches,
runs the model, and must leave every layer as it found it, a `call` set on the
instance included, also when the model raises.

Example:

    def counting(layer, call):
        def counted(*args, **kwargs):
            counts[layer.name] = counts.get(layer.name, 0) + 1
            return call(*args, **kwargs)
        return counted

    with calls_wrapped(model.layers, counting):
        model(batch)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras

# One block at a time may replace the one `Layer.__call__`.
_CLASS_LOCK = threading.Lock()


@contextlib.contextmanager
def calls_wrapped(
    layers: Iterable[keras.layers.Layer],
    wrap: Callable[[keras.layers.Layer, Callable[..., Any]], Callable[..., Any]],
) -> Iterator[None]:
    """Gives each layer the `call` that `wrap(layer, its call)` returns, inside the block.

    Args:
        layers: The layers; one given twice is wrapped twice.
        wrap: Makes a layer's new `call` from the layer and its `call`.

    Yields:
        Nothing; on exit, even on error, each layer's `call` is as it was: the
        class's, or the one set on the instance before.
    """
    wrapped = []
    try:
        for layer in layers:
            own_call = vars(layer).get("call")
            layer.call = wrap(layer, layer.call)
            wrapped.append((layer, own_call))
        yield
    finally:
        for layer, own_call in reversed(wrapped):  # A layer wrapped twice unwinds in order.
            if own_call is None:
                del layer.call
            else:
                layer.call = own_call


@contextlib.contextmanager
def calls_before_cast(
    record: Callable[[keras.layers.Layer, tuple[Any, ...], dict[str, Any], Any], None],
) -> Iterator[None]:
    """Calls `record(layer, args, kwargs, outputs)` as each layer call returns, inside the block.

    Only the calls this thread makes: other threads' layers run unwatched.
    `Layer.__call__` is put back on exit, even on error.
    """
    layer_class = keras.layers.Layer
    original = vars(layer_class)["__call__"]
    thread = threading.get_ident()

    @functools.wraps(original)
    def recording_call(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        if threading.get_ident() == thread:
            record(self, args, kwargs, outputs)
        return outputs

    with _CLASS_LOCK:
        layer_class.__call__ = recording_call
        try:
            yield
        finally:
            layer_class.__call__ = original

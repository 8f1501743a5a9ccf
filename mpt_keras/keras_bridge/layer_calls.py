"""Layer calls watched for the length of a block: how the toolkit watches a model run.

`calls_wrapped` wraps the method Keras runs for each chosen layer (`call`, or a quantized
layer's `quantized_call`), which sees the inputs after Keras cast them to the compute dtype;
`calls_before_cast` wraps `Layer.__call__` for every layer, which sees them as the caller
gave them (a float32 value too large for the float16 layer it feeds is still finite there;
diagnosis needs that). Both leave every layer as they found it, a
`call` set on the instance included, also when the model raises.
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

    The method wrapped is the one Keras runs for the layer, `run_method` (a float8 layer's
    `call` never runs, so wrapping it would miss every call). A layer given twice is wrapped
    twice. On exit, even on error, each method is as it was: the class's, or the one set on
    the instance before.
    """
    wrapped = []
    try:
        for layer in layers:
            name = run_method(layer)
            own_call = vars(layer).get(name)
            setattr(layer, name, wrap(layer, getattr(layer, name)))
            wrapped.append((layer, name, own_call))
        yield
    finally:
        for layer, name, own_call in reversed(wrapped):  # A layer wrapped twice unwinds in order.
            if own_call is None:
                delattr(layer, name)
            else:
                setattr(layer, name, own_call)


def run_method(layer: keras.layers.Layer) -> str:
    """The method Keras' `__call__` runs for `layer`: `quantized_call` for a quantized layer
    (`layer.quantize`: float8, int8, ...), else `call`."""
    return "call" if getattr(layer, "quantization_mode", None) is None else "quantized_call"


@contextlib.contextmanager
def calls_before_cast(
    record: Callable[[keras.layers.Layer, tuple[Any, ...], dict[str, Any], Any], None],
) -> Iterator[None]:
    """Calls `record(layer, args, kwargs, outputs)` as each layer call returns, inside the block.

    Only this thread's calls: other threads' layers run unwatched.
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

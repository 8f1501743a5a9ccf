"""A layer set apart from the block calling it hands its outputs back in the block's dtype.

A manifest computes normalization layers in float32 (a safe default), while the block around
them may compute in bfloat16. Inside a block's own `call` (a keras_hub `TransformerEncoder`,
a layer or subclassed model of yours), the norm's output then meets the block's tensors in
raw ops: BERT's post-norm `x + residual` adds a float32 output to a bfloat16 residual, which
TensorFlow refuses (`AddV2`: "expected to be a bfloat16 tensor but is a float tensor") and
JAX promotes (the residual stream, and every op after it, silently float32). So the norm
computes in float32 and returns the block's dtype, as Keras' own `LayerNormalization` does
under a mixed policy: the statistics keep float32, and the output, normalized, fits.

The other way round, a block making a model output is float32 (a safe default) around
sublayers in bfloat16: they hand theirs back widened to float32 (`widen_only`), which
loses nothing. Any other layer keeps its outputs: a float32 `Dense` may be there for its
range, which a float16 block would overflow.

Who hands back to whom is set when a manifest is applied (`application.py`); the dtype is
read at each call, from the two layers' policies then, so that policies set later
(calibration's trials, a promotion) are followed. Both methods Keras may run are wrapped
(`call`, and `quantized_call` once a layer is quantized, even after the manifest).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import keras

from mpt_keras.precision.policies import effective_policy

_METHODS = ("call", "quantized_call")


@dataclasses.dataclass(frozen=True)
class HandBack:
    """The layer whose `call` a layer hands its outputs back to, and whether only where
    that widens them to float32."""

    caller: keras.layers.Layer
    widen_only: bool = False


# {layer: (the caller, weakly (it holds the layer), widen_only, the methods the instance
# held itself before)}. Nothing in a value holds the layer: the entry goes with it.
_HANDED_BACK: weakref.WeakKeyDictionary[Any, tuple[weakref.ref, bool, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def hand_back(layer: keras.layers.Layer, to: HandBack | None) -> None:
    """Makes `layer` return its floating outputs in `to.caller`'s compute dtype from now on,
    where it computes in another; None: as it makes them (undoing an earlier `hand_back`).

    The methods Keras runs are wrapped on the instance: a copy (`clone_model`) or a loaded
    model returns them as made.
    """
    kept = _HANDED_BACK.pop(layer, None)
    if kept is not None:
        for name in _METHODS:
            wrapper = vars(layer).pop(name, None)
            if name in kept[2]:  # A method of the user's own, wrapped: put back.
                setattr(layer, name, wrapper.__wrapped__)
    if to is None:
        return
    owned = tuple(name for name in _METHODS if name in vars(layer))
    for name in _METHODS:
        setattr(layer, name, _handing_back(layer, getattr(layer, name)))
    _HANDED_BACK[layer] = (weakref.ref(to.caller), to.widen_only, owned)


def hand_back_of(layer: keras.layers.Layer) -> HandBack | None:
    """What `layer` hands its outputs back to (`hand_back`), or None."""
    kept = _HANDED_BACK.get(layer)
    caller = kept[0]() if kept else None
    return HandBack(caller, kept[1]) if caller is not None else None


def handed_back_dtype(layer: keras.layers.Layer) -> str | None:
    """The dtype `layer` returns its floating outputs in now: its caller's compute dtype,
    where that differs from its own (and, `widen_only`, is float32); else None."""
    to = hand_back_of(layer)
    if to is None:
        return None
    dtype = effective_policy(to.caller).compute_dtype
    if dtype == effective_policy(layer).compute_dtype or (to.widen_only and dtype != "float32"):
        return None
    return dtype


def _handing_back(layer: keras.layers.Layer, method: Any) -> Any:
    @functools.wraps(method)
    def handing_back(*args, **kwargs):
        outputs = method(*args, **kwargs)
        dtype = handed_back_dtype(layer)
        if dtype is None:
            return outputs
        return keras.tree.map_structure(lambda value: _cast_floating(value, dtype), outputs)

    return handing_back


def _cast_floating(value: Any, dtype: str) -> Any:
    if not keras.ops.is_tensor(value) and not isinstance(value, keras.KerasTensor):
        return value
    if not keras.backend.is_float_dtype(value.dtype):
        return value
    if keras.backend.standardize_dtype(value.dtype) == dtype:
        return value
    return keras.ops.cast(value, dtype)

"""Keras dtype policies: the global one for a block, and the one a layer computes with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from mpt_keras.precision.names import check_policy_name


@contextlib.contextmanager
def global_policy(name: str) -> Iterator[keras.DTypePolicy]:
    """Sets the global Keras dtype policy inside a `with` block; restored on exit, even on error.

    Raises `UserInputError` for a name not in `names.POLICY_NAMES`.
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(check_policy_name(name))
    try:
        yield keras.config.dtype_policy()
    finally:
        keras.config.set_dtype_policy(previous)


def effective_policy(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The policy `layer` computes with, looked up in its `DTypePolicyMap` if any (after
    `PrecisionManifest.apply` or loading); as in Keras, a layer without a path (weightless,
    nested) uses the map's default."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy

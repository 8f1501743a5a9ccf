"""Keras dtype policies: choosing the global one and describing a model's.

A precision name is a Keras dtype policy name: `float32`, `mixed_float16` or
`mixed_bfloat16` (`mixed_*` compute in the low-precision type and keep float32
variables). `precision_report` lists what every layer of a built model computes
in, which is what `precision_report.json` in a run's `model_dir` holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras

from mpt_keras.errors import UserInputError

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")


def check_policy_name(name: str, source: str = "precision") -> str:
    """Returns `name` if it is a supported policy name.

    Raises:
        UserInputError: Naming `source` and the allowed names otherwise.
    """
    if name not in POLICY_NAMES:
        raise UserInputError(
            f"{source}: unknown policy '{name}'. Allowed: {', '.join(POLICY_NAMES)}"
        )
    return name


@contextlib.contextmanager
def global_policy(name: str) -> Iterator[keras.DTypePolicy]:
    """Sets the global Keras dtype policy for the duration of a `with` block.

    Layers created inside the block take the policy by default; the previous
    global policy is restored on exit, even on error.

    Example:

        with global_policy("mixed_bfloat16"):
            model = keras.Sequential([keras.layers.Dense(4)])
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(check_policy_name(name))
    try:
        yield keras.config.dtype_policy()
    finally:
        keras.config.set_dtype_policy(previous)


def precision_report(model: keras.Model) -> dict[str, Any]:
    """Describes the precision of every layer of `model`, nested ones included.

    Args:
        model: A built model.

    Returns:
        `{"model": name, "layers": [...]}` where each layer entry holds `path`
        (the layer names from the model down, joined by "/"), `class`,
        `policy`, `compute_dtype` and `variable_dtype`, in depth-first order;
        and `"trainable_variables"`: how many trainable variables have each
        dtype (the master weights: all float32 under a `mixed_*` policy).
    """
    layers = [
        {
            "path": path,
            "class": type(layer).__name__,
            "policy": layer.dtype_policy.name,
            "compute_dtype": layer.compute_dtype,
            "variable_dtype": layer.variable_dtype,
        }
        for path, layer in iter_layers(model)
    ]
    variable_dtypes: dict[str, int] = {}
    for variable in model.trainable_variables:
        variable_dtypes[variable.dtype] = variable_dtypes.get(variable.dtype, 0) + 1
    return {"model": model.name, "layers": layers, "trainable_variables": variable_dtypes}


def iter_layers(layer: keras.layers.Layer, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields `(path, layer)` for every sublayer of `layer`, depth first.

    Paths are built from layer names, so layers without weights (dropout,
    softmax) have one too; for layers with weights they equal Keras' own
    `layer.path`.
    """
    for child in layer._flatten_layers(include_self=False, recursive=False):
        if isinstance(child, keras.layers.InputLayer):
            continue
        path = f"{prefix}{child.name}"
        yield path, child
        yield from iter_layers(child, prefix=path + "/")

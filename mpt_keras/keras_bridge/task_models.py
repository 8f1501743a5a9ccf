"""Keras' own `fit` and `evaluate` for keras_hub task models built without a preprocessor.

keras_hub's task models (`keras_hub.models.Task`: `GPT2CausalLM`, `BertTextClassifier`, ...)
override `fit`, `evaluate` and `predict` to batch and preprocess their data themselves. They
take a `tf.data` or grain dataset, or arrays they slice with one of those, but not the
iterator of batches a run feeds on Keras' JAX backend: there `mpt-train` stopped at its first
step in TensorFlow's words ("Attempt to convert a value (<generator ...>)"), and on a machine
with neither TensorFlow nor grain even arrays fail. Built with `preprocessor=None`, a task's
override adds nothing to the batches a run makes, which are its inputs already, so the runs
call Keras' own methods on it. Every other model's are its own (a user's override included).
A task with a preprocessor is refused before anything is built on it (`check_no_preprocessor`):
the run makes the model's inputs itself, from the data factory's.
"""

from __future__ import annotations

import sys
from typing import Any

import keras

from mpt_keras.errors import UserInputError


def fit(model: keras.Model, *args: Any, **kwargs: Any) -> Any:
    """`model.fit(*args, **kwargs)`, Keras' own for a keras_hub task (see the module)."""
    return _method(model, "fit")(*args, **kwargs)


def evaluate(model: keras.Model, *args: Any, **kwargs: Any) -> Any:
    """`model.evaluate(*args, **kwargs)`, Keras' own for a keras_hub task (see the module)."""
    return _method(model, "evaluate")(*args, **kwargs)


def check_no_preprocessor(model: keras.Model, source: str) -> None:
    """A one-line `UserInputError` if `model` is a keras_hub task holding a preprocessor;
    `source`: what made it, for the message (`the model factory`)."""
    preprocessor = getattr(model, "preprocessor", None) if _is_task(model) else None
    if preprocessor is not None:
        raise UserInputError(
            f"{source} returned a keras_hub {type(model).__name__} with a preprocessor "
            f"({type(preprocessor).__name__}), but the run feeds the model its inputs itself, "
            "batched from the data's. Allowed: the task built with preprocessor=None, its "
            "inputs (token ids, masks) made by the data factory"
        )


def _method(model: keras.Model, name: str) -> Any:
    if _is_task(model) and getattr(model, "preprocessor", None) is None:
        return getattr(keras.Model, name).__get__(model)
    return getattr(model, name)


def _is_task(model: keras.Model) -> bool:
    keras_hub = sys.modules.get("keras_hub")  # The user's dependency: imported if they use it.
    return keras_hub is not None and isinstance(model, keras_hub.models.Task)

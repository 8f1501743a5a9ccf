"""Reference models, built by name from a `ModelConfig`.

Each model belongs to a task, which decides the data it is fed:

    mlp, cnn          classification: images -> class logits
    transformer_lm    language_model: byte tokens -> next-byte logits
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import keras

from mpt_keras.errors import UserInputError
from mpt_keras.models.image import build_cnn, build_mlp
from mpt_keras.models.transformer import DecoderBlock, PositionEmbedding, build_transformer_lm

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"


@dataclasses.dataclass(frozen=True)
class _Entry:
    builder: Callable[..., keras.Model]
    task: str


_MODELS = {
    "mlp": _Entry(build_mlp, CLASSIFICATION),
    "cnn": _Entry(build_cnn, CLASSIFICATION),
    "transformer_lm": _Entry(build_transformer_lm, LANGUAGE_MODEL),
}
MODEL_NAMES = tuple(_MODELS)


def model_task(name: str) -> str:
    """The task (`classification` or `language_model`) of model `name`."""
    return _entry(name).task


def build_model(name: str, options: Mapping[str, Any], **dimensions: Any) -> keras.Model:
    """Builds reference model `name`.

    Args:
        name: One of `MODEL_NAMES`.
        options: The builder's keyword-only hyperparameters (from the config).
        **dimensions: What the data decides: `input_shape` and `num_classes`
            for classifiers, `vocab_size` and `sequence_length` for LMs.

    Returns:
        The model, with the current global dtype policy.

    Raises:
        UserInputError: On an unknown model name or option.
    """
    builder = _entry(name).builder
    allowed = [
        parameter.name
        for parameter in inspect.signature(builder).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UserInputError(
            f"unknown option 'model.options.{unknown[0]}' for model '{name}'. "
            f"Allowed: {', '.join(allowed)}"
        )
    try:
        return builder(**dimensions, **options)
    except (TypeError, ValueError) as error:
        raise UserInputError(
            f"model '{name}' cannot be built from model.options: {error}"
        ) from None


def _entry(name: str) -> _Entry:
    if name not in _MODELS:
        raise UserInputError(
            f"unknown model '{name}' (key 'model.name'). Allowed: {', '.join(MODEL_NAMES)}"
        )
    return _MODELS[name]


__all__ = [
    "CLASSIFICATION",
    "LANGUAGE_MODEL",
    "MODEL_NAMES",
    "DecoderBlock",
    "PositionEmbedding",
    "build_cnn",
    "build_mlp",
    "build_model",
    "build_transformer_lm",
    "model_task",
]

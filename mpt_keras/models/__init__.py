"""Reference models, built by name from a `ModelConfig`; a model's task decides its data.

image.py        mlp, cnn (classification): images -> class logits
transformer.py  transformer_lm (language_model): byte tokens -> next-byte logits
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import keras

from mpt_keras.checks import check_choice
from mpt_keras.config import MODEL_NAMES
from mpt_keras.errors import UserInputError
from mpt_keras.models.image import build_cnn, build_mlp
from mpt_keras.models.transformer import DecoderBlock, PositionEmbedding, build_transformer_lm

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"
# Every reference model ends in logits.
REFERENCE_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
REFERENCE_METRICS = ("accuracy",)


@dataclasses.dataclass(frozen=True)
class _Entry:
    builder: Callable[..., keras.Model]
    task: str


# The names live in config, checked without TensorFlow (tests/test_models.py: they agree).
_MODELS = {
    "mlp": _Entry(build_mlp, CLASSIFICATION),
    "cnn": _Entry(build_cnn, CLASSIFICATION),
    "transformer_lm": _Entry(build_transformer_lm, LANGUAGE_MODEL),
}


def model_task(name: str) -> str:
    """The task (`classification` or `language_model`) of model `name`."""
    return _entry(name).task


def build_model(name: str, options: Mapping[str, Any], **dimensions: Any) -> keras.Model:
    """Builds reference model `name` with the current global dtype policy.

    `options`: the builder's keyword-only hyperparameters; `dimensions`: what the data decides
    (`input_shape`, `num_classes` or `vocab_size`, `sequence_length`; others dropped).
    `UserInputError`: an unknown model name or option.
    """
    builder = _entry(name).builder
    allowed = [
        parameter.name
        for parameter in inspect.signature(builder).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    needed = [
        parameter.name
        for parameter in inspect.signature(builder).parameters.values()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    missing = [name_ for name_ in needed if dimensions.get(name_) is None]
    if missing:
        raise UserInputError(
            f"model '{name}' needs {missing[0]!r}, which the data does not decide. Allowed: "
            "data whose factory returns it as a dimension, such as (train, eval, "
            f"{{{missing[0]!r}: ...}})"
        )
    dimensions = {name_: dimensions[name_] for name_ in needed}
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
    return _MODELS[check_choice("key 'model.name'", name, MODEL_NAMES)]


__all__ = [
    "CLASSIFICATION",
    "LANGUAGE_MODEL",
    "MODEL_NAMES",
    "REFERENCE_LOSS",
    "REFERENCE_METRICS",
    "DecoderBlock",
    "PositionEmbedding",
    "build_cnn",
    "build_mlp",
    "build_model",
    "build_transformer_lm",
    "model_task",
]

"""The run's untrained model built with each layer's precision, and what looks unmeant logged."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import keras

from mpt_keras.config import TrainConfig
from mpt_keras.data import RunData
from mpt_keras.errors import UserInputError, describe_error
from mpt_keras.keras_bridge import task_models
from mpt_keras.precision.hardware import resolve_auto_policy
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import PrecisionReport
from mpt_keras.runs.resolution import Components

_LOGGER = logging.getLogger(__name__)


def build_model(
    config: TrainConfig,
    components: Components,
    data: RunData,
    manifest_file: PrecisionManifest | None = None,
) -> tuple[keras.Model, PrecisionManifest, PrecisionReport]:
    """Builds the model, gives each layer its policy, logs what looks unmeant.

    A manifest (`manifest_file`, if read) decides every layer, else `config.precision` with
    the safe defaults. Returns the model, the manifest applied, its report (`auto` resolved).
    """
    precision, reason = _resolve_precision(config.precision)
    if config.manifest is None:
        manifest = PrecisionManifest(default=precision)
    else:
        manifest = manifest_file or PrecisionManifest.from_json(config.manifest)
        if manifest.default != precision:
            _LOGGER.info(
                "Manifest %s decides each layer's policy (default %s): precision %s is not used.",
                config.manifest,
                manifest.default,
                precision,
            )
    keras.utils.set_random_seed(config.seed)
    with global_policy(manifest.default):
        try:
            model = components.model(**data.dimensions)
        except UserInputError:
            raise
        except Exception as error:  # The user's code: its error, in one line.
            raise UserInputError(f"the model factory failed: {describe_error(error)}") from None
        if not isinstance(model, keras.Model):
            raise UserInputError(
                f"the model factory returned {type(model).__name__}. Allowed: a keras.Model"
            )
        task_models.check_no_preprocessor(model, "the model factory")
        # Before the manifest and the optimizer, which need every variable.
        example = build_on_data(model, data)
        applied = manifest.apply(model, inputs=example)
    for layer in applied.layers:
        if layer.path in applied.output_dtype_mismatches:
            _LOGGER.warning(
                "Layer %s (%s) computes in %s but outputs %s: an op in its call mixes in a "
                "%s value (a NumPy array, a variable) or casts to it; cast to "
                "self.compute_dtype if that is not meant.",
                layer.path,
                layer.layer_class,
                layer.compute_dtype,
                layer.output_dtype,
                layer.output_dtype,
            )
    for rule in applied.unmatched_rules:
        _LOGGER.warning("Manifest rule %s matched no layer.", rule)
    for rule in applied.shadowed_rules:
        _LOGGER.warning("Manifest rule %s only matched layers an earlier rule decided.", rule)
    report = dataclasses.replace(
        applied,
        precision=manifest.default if config.manifest else precision,
        precision_reason=reason,
        manifest=config.manifest,
    )
    return model, manifest, report


def build_on_data(model: keras.Model, data: RunData) -> Any:
    """Builds `model` on one evaluation example if need be; returns that example's inputs."""
    example = keras.utils.unpack_x_y_sample_weight(next(iter(data.eval_batches(1))))[0]
    if not model.built:
        model(example)
    return example


def _resolve_precision(precision: str) -> tuple[str, str | None]:
    if precision != "auto":
        return precision, None
    policy, reason = resolve_auto_policy()
    _LOGGER.info("precision auto -> %s: %s", policy, reason)
    return policy, reason

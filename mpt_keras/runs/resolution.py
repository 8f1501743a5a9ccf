"""Where a run's model, data, loss and metrics come from: a config, or the user's objects.

Resolved, nothing built: a bad reference fails before the run starts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from mpt_keras import data as data_lib
from mpt_keras import models
from mpt_keras.config import TrainConfig
from mpt_keras.config import components as components_lib
from mpt_keras.data import RunData
from mpt_keras.errors import UserInputError
from mpt_keras.runs import keras_objects

# The data shape each reference task reads.
_SHAPES = {models.CLASSIFICATION: "image", models.LANGUAGE_MODEL: "text"}


@dataclasses.dataclass(frozen=True)
class Components:
    """A run's resolved components.

    `model`: a fresh model from the data's dimensions (keywords), under the run's policy and
    seed. `data`: loads the `RunData` once the strategy exists. `metrics`: makers (one per
    model). `task`: the reference models' (`models.LANGUAGE_MODEL`...) or None.
    """

    model: Callable[..., keras.Model]
    data: Callable[[], RunData]
    loss: Any
    metrics: tuple[Callable[[], Any], ...]
    task: str | None = None


def resolve_components(config: TrainConfig) -> Components:
    """Imports `config.imports`, binds every factory to its options; builds nothing."""
    components_lib.import_modules(config.imports)
    source = config.model
    task = None
    if source.name is not None:
        task = models.model_task(source.name)
        model = functools.partial(models.build_model, source.name, source.options)
    elif source.factory is not None:
        model = components_lib.bind_factory(
            source.factory,
            source.options,
            "model.factory",
            provided=components_lib.DATA_DIMENSIONS,
        )
    else:
        model = functools.partial(keras_objects.load_model_file, source.file)
    compiled = keras_objects.compiled_with(source.file) if source.file else {}
    loss = keras_objects.loss_from(config.loss, source, compiled)
    metrics = keras_objects.metrics_from(config.metrics, source, compiled)
    data_factory = None
    if config.data.factory is not None:
        data_factory = components_lib.bind_factory(
            config.data.factory, config.data.options, "data.factory", provided=("seed",)
        )
    return Components(
        model=model,
        data=functools.partial(
            data_lib.load_run_data, config.data, config.seed, _SHAPES.get(task), data_factory
        ),
        loss=loss,
        metrics=metrics,
        task=task,
    )


def components_from_objects(
    model: keras.Model | Callable[[], keras.Model],
    data: tuple[Any, Any],
    loss: Any,
    metrics: Sequence[Any],
    batching: str,
) -> Components:
    """Components from the user's own objects.

    `model`: a fresh-model function (per precision), or a functional or Sequential model
    (cloned). `data`: `(train, eval)`, each a `tf.data.Dataset` of unbatched
    `(x, y[, sample_weight])`, or such arrays. `batching`: named if data is batched.
    """
    if isinstance(model, keras.Model):
        original = model

        def model(**dimensions: Any) -> keras.Model:
            del dimensions
            return keras_objects.clone_model(original)

    elif callable(model):
        factory = model

        def model(**dimensions: Any) -> keras.Model:
            del dimensions
            return factory()

    else:
        raise UserInputError(
            f"model: received {type(model).__name__}. Allowed: a keras.Model or a function "
            "returning one"
        )
    allowed = (
        "Allowed: a tuple (train, eval) of tf.data.Datasets or of (x, y) or (x, y, "
        "sample_weight) array tuples"
    )
    if not (isinstance(data, tuple) and len(data) == 2):
        raise UserInputError(f"data: received {type(data).__name__}. {allowed}")
    if isinstance(data[0], (np.ndarray, dict, list)):  # Arrays, not a split: (x, y).
        raise UserInputError(
            f"data: received ({type(data[0]).__name__}, {type(data[1]).__name__}), arrays "
            f"(x, y) rather than splits. {allowed}: data=((x, y), (x_eval, y_eval))"
        )
    run_data = RunData(
        data_lib.checked_split(data[0], "data[0]", batching),
        data_lib.checked_split(data[1], "data[1]", batching),
        {},
    )
    makers = tuple(functools.partial(keras_objects.fresh_metric, metric) for metric in metrics)
    return Components(model, lambda: run_data, loss, makers)


def resolve(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    *,
    data: tuple[Any, Any] | None = None,
    loss: Any = None,
    metrics: Sequence[Any] = (),
    config: TrainConfig | None = None,
) -> tuple[TrainConfig, Components]:
    """A run's settings and components: a `TrainConfig`'s, or the user's objects'.

    A model needs `data` and `loss`; `config` then gives only settings (default `TrainConfig()`).
    """
    if isinstance(model, TrainConfig):
        if config is not None or data is not None or loss is not None or metrics:
            raise UserInputError(
                "a TrainConfig names its own components: received it with data, loss, metrics "
                "or config too. Allowed: a TrainConfig alone, or a model with data and loss"
            )
        return model, resolve_components(model)
    if data is None or loss is None:
        missing = "data" if data is None else "loss"
        raise UserInputError(
            f"{missing}: required with a model of your own. Allowed: data=(train, eval) "
            "and loss=a Keras loss"
        )
    config = config or TrainConfig()
    batching = f"config.data.batch_size: {config.data.batch_size}"
    return config, components_from_objects(model, data, loss, metrics, batching)

"""Keras objects a config names: losses, metrics, and `.keras` files' models.

A loss or metric is a Keras identifier (with `options`: its class, snake_case resolving to
CamelCase) or the user's factory; a `.keras` file brings its model, loss and metrics.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import keras

from mpt_keras import models
from mpt_keras.backend import current
from mpt_keras.config import ComponentConfig, ModelConfig
from mpt_keras.config.components import bind_factory, resolve_factory
from mpt_keras.errors import UserInputError, first_line


def load_model_file(path: str, **dimensions: Any) -> keras.Model:
    """A `.keras` file's model, uncompiled: a factory whose file decides its shape."""
    del dimensions  # A file decides its own.
    try:
        return keras.saving.load_model(path, compile=False)
    except (ValueError, TypeError, OSError, zipfile.BadZipFile) as error:
        raise UserInputError(
            f"model.file {path}: cannot be loaded ({type(error).__name__}: {first_line(error)}). "
            "Allowed: a .keras file saved by model.save, its custom classes registered "
            "(config key 'imports')"
        ) from None


def compiled_with(path: str) -> dict[str, Any]:
    """A `.keras` file's compiled loss, and its metrics still serialized (`{}`: none)."""
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as error:
        raise UserInputError(
            f"model.file {path}: not a Keras archive ({error}). Allowed: a .keras file saved "
            "by model.save"
        ) from None
    compile_config = config.get("compile_config") or {}
    loss = compile_config.get("loss")
    return {
        "loss": None if loss is None else keras.saving.deserialize_keras_object(loss),
        "metrics": compile_config.get("metrics"),
    }


def loss_from(
    config: ComponentConfig | None, model_source: ModelConfig, compiled: Mapping[str, Any]
) -> Any:
    """The run's loss: the config's, else the reference models' or a model file's."""
    if config is not None:
        return _keras_component(config, keras.losses, "loss")()
    if model_source.name is not None:
        return models.REFERENCE_LOSS
    if compiled.get("loss") is None:
        raise UserInputError(
            f"model.file {model_source.file} was saved without a compiled loss. "
            "Allowed: name one with the config key 'loss'"
        )
    return compiled["loss"]


def metrics_from(
    configs: tuple[ComponentConfig, ...] | None,
    model_source: ModelConfig,
    compiled: Mapping[str, Any],
) -> tuple[Callable[[], Any], ...]:
    """The run's metric makers (the config's, else the reference models' or a file's); a
    metric holds state, so each model gets its own, made under the run's strategy."""
    if configs is not None:
        return tuple(
            _keras_component(config, keras.metrics, f"metrics[{index}]")
            for index, config in enumerate(configs)
        )
    if model_source.name is not None:
        return tuple(functools.partial(str, name) for name in models.REFERENCE_METRICS)
    if model_source.file is not None:
        return tuple(
            functools.partial(keras.saving.deserialize_keras_object, metric)
            for metric in keras.tree.flatten(compiled.get("metrics") or [])
        )
    return ()


def fresh_metric(metric: Any) -> Any:
    """`metric` for another model: a metric object copied, anything else as is."""
    if isinstance(metric, keras.metrics.Metric):
        return type(metric).from_config(metric.get_config())
    return metric


def _no_runtime_started() -> Any:
    """On TensorFlow, a graph of its own: checking a name must not start TF's runtime (which
    would fix the CPU's devices before a strategy splits them). On JAX the metric made here
    starts JAX: `run_training` splits its CPU before (`placement.make_placement`)."""
    if current.is_jax():
        return contextlib.nullcontext()
    from mpt_keras.backend.tensorflow.devices import graph_of_its_own

    return graph_of_its_own()


def _keras_component(config: ComponentConfig, module: Any, key: str) -> Callable[[], Any]:
    """A loss or metric maker from a Keras identifier or the user's factory."""
    kind = module.__name__.rpartition(".")[2]
    if config.factory is not None:
        function = resolve_factory(config.factory, f"{key}.factory")
        if isinstance(function, type) or config.options or not _required_arguments(function):
            return bind_factory(config.factory, config.options, f"{key}.factory")
        return lambda: function
    if not config.options:
        if kind == "metrics" and config.name in _COMPILE_METRIC_NAMES:
            return functools.partial(str, config.name)
        try:
            with _no_runtime_started():
                module.get(config.name)
        except ValueError:
            raise UserInputError(
                f"key '{key}.name': unknown {_SINGULAR[kind]} {config.name!r}. Allowed: a name of "
                f"keras.{kind} (such as {_examples(kind)}) or a factory"
            ) from None
        # Keras resolves names, picking the accuracy that fits the loss.
        return functools.partial(str, config.name)
    class_name = config.name if config.name[:1].isupper() else _camel(config.name)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UserInputError(
            f"key '{key}.name': {config.name!r} with options needs a class of keras.{kind}; "
            f"there is no keras.{kind}.{class_name}. Allowed: a class name such as "
            f"{_examples(kind, classes=True)}"
        )
    unknown = sorted(set(config.options) - set(_parameters(cls)))
    if unknown:
        raise UserInputError(
            f"unknown option '{key}.options.{unknown[0]}' for keras.{kind}.{class_name}. "
            f"Allowed: {', '.join(_parameters(cls))}"
        )
    return functools.partial(cls, **config.options)


_SINGULAR = {"losses": "loss", "metrics": "metric"}
# Names `Model.compile` resolves (by the loss) that `keras.metrics.get` does not know.
_COMPILE_METRIC_NAMES = ("acc", "crossentropy", "ce")


def _required_arguments(function: Callable[..., Any]) -> int:
    """How many arguments `function` needs: none for a factory (`make_loss()`), two for a loss
    or metric itself (`loss(y_true, y_pred)`), as a builtin without a signature is taken."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(
        parameter.default is inspect.Parameter.empty
        and parameter.kind is not inspect.Parameter.VAR_KEYWORD
        and parameter.kind is not inspect.Parameter.VAR_POSITIONAL
        for parameter in parameters
    )


def _parameters(cls: type) -> list[str]:
    return [name for name in inspect.signature(cls).parameters if name not in ("args", "kwargs")]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _examples(kind: str, classes: bool = False) -> str:
    if kind == "losses":
        return "SparseCategoricalCrossentropy" if classes else "sparse_categorical_crossentropy"
    return "SparseCategoricalAccuracy" if classes else "accuracy"


def clone_model(model: keras.Model) -> keras.Model:
    """A fresh copy of a functional or Sequential model, weights included."""
    try:
        clone = keras.models.clone_model(model)
    except (NotImplementedError, TypeError, ValueError) as error:
        raise UserInputError(
            f"model {model.name!r} ({type(model).__name__}) cannot be cloned for each "
            f"precision ({error}). Allowed: a function returning a fresh model"
        ) from None
    clone.set_weights(model.get_weights())
    return clone

"""What `mpt-bench` trains: a reference model on synthetic batches, or a run config's own.

A `Workload` is one model of the suite: how to build it (in the global dtype
policy, from the same initial weights at every call, so that every variant of
it starts alike), its endless train batches (the same at every call, so that
every variant sees the same ones), the loss it trains with, and how the
result describes it.

    reference     `transformer_lm`, `cnn` or `mlp` (`harness`) from seed 0, on
                  random tokens or 8x8 images, with `models.REFERENCE_LOSS`;
                  sized by the suite's settings
    from_config   a run config's model, data and loss, through the run
                  assembly (`runs.resolve_components`) as `mpt-train` trains
                  them: whatever the config names (a reference model, a
                  `model.factory`, a `model.file`; built-in, TFDS or
                  factory data); batches of `data.batch_size` from
                  `RunData.train_batches` with the config's seed and
                  `data.shuffle_buffer`

A config's model is built once in float32 as a run builds it
(`runs.build_model`: the user's errors in one line, a subclassed model built
on a batch); its weights then start every variant. A `model.file`'s layers
keep the policies they were saved with whatever the global policy, so each
variant first gives every layer the global one, as if it had been built under
it. The config's precision, manifest, optimizer, metrics, strategy and XLA
setting are not used: the variants decide those.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

import keras
import tensorflow as tf

from benchmarks import harness
from mpt_keras import models
from mpt_keras.config import TrainConfig
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.runs import assembly as runs

LANGUAGE_MODEL = "transformer_lm"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model the suite measures, with its data and loss.

    Attributes:
        name: Its name in the variants' names: a reference model's, or the
            config file's stem.
        build: Returns the model, in the current global dtype policy, with the
            same initial weights at every call.
        batches: Returns its endless dataset of full train batches, the same
            batches in the same order at every call.
        loss: The loss it trains with (as `model.compile` takes it).
        batch_size: Examples per batch.
        tokens_per_example: Tokens in an example of a sequence model (for
            tokens per second), else `None`.
        description: What the result's `models` says about it (JSON-ready).
    """

    name: str
    build: Callable[[], keras.Model]
    batches: Callable[[], tf.data.Dataset]
    loss: Any
    batch_size: int
    tokens_per_example: int | None
    description: Mapping[str, Any]


def reference(
    name: str, batch_size: int, sequence_length: int, num_layers: int, d_model: int
) -> Workload:
    """The reference model `name` on synthetic batches (`harness`).

    `batch_size` is in sequences for the Transformer LM, in images otherwise;
    the other sizes are the Transformer LM's.
    """
    if name == LANGUAGE_MODEL:
        description = harness.transformer_lm_description(
            num_layers, d_model, sequence_length, batch_size
        )
    else:
        description = {
            "name": name,
            "input_shape": list(harness.IMAGE_SHAPE),
            "batch_size": batch_size,
        }
    return Workload(
        name=name,
        build=functools.partial(
            harness.reference_model, name, sequence_length, num_layers, d_model
        ),
        batches=functools.partial(harness.reference_batches, name, batch_size, sequence_length),
        loss=models.REFERENCE_LOSS,
        batch_size=batch_size,
        tokens_per_example=sequence_length if name == LANGUAGE_MODEL else None,
        description=description,
    )


def from_config(config: TrainConfig, name: str) -> Workload:
    """The model, data and loss of a run config, through the run assembly.

    Loads the data and builds the model once in float32 (see the module
    docstring), so a bad factory, option or file fails here, before anything
    is measured.

    Args:
        config: A resolved run config (`mpt_keras.config.resolve_config`).
        name: Its name in the result, e.g. the config file's stem.

    Raises:
        UserInputError: For a component that cannot be resolved, loaded or
            built, naming the key and what is allowed.
    """
    components = runs.resolve_components(config)
    data = components.data()
    float32 = dataclasses.replace(config, precision="float32", manifest=None)
    model, _, _ = runs.build_model(float32, components, data)
    initial_weights = model.get_weights()
    parameters = model.count_params()
    del model

    def build() -> keras.Model:
        keras.utils.set_random_seed(config.seed)
        built = components.model(**data.dimensions)
        runs.build_on_data(built, data)  # As the run assembly builds it.
        if config.model.file is not None:
            policy = keras.config.dtype_policy().name
            PrecisionManifest(default=policy, safe_defaults=False).apply(built)
        built.set_weights(initial_weights)
        return built

    batches = functools.partial(
        data.train_batches,
        config.data.batch_size,
        config.seed,
        shuffle_buffer=config.data.shuffle_buffer,
    )
    inputs = keras.utils.unpack_x_y_sample_weight(batches().element_spec)[0]
    source = {key: value for key, value in dataclasses.asdict(config.model).items() if value}
    return Workload(
        name=name,
        build=build,
        batches=batches,
        loss=components.loss,
        batch_size=config.data.batch_size,
        tokens_per_example=data.dimensions.get("sequence_length"),
        description={
            "name": name,
            "model": source,
            "loss": _describe_loss(components.loss),
            "batch_size": config.data.batch_size,
            "inputs": describe_inputs(inputs),
            "dimensions": _json_ready(dict(data.dimensions)),
            "parameters": parameters,
        },
    )


def describe_inputs(spec: Any) -> Any:
    """The shape and dtype of each input of a batch, nested as the inputs are.

    Args:
        spec: A batch's input spec: a `tf.TensorSpec`, or a dict, list or
            tuple of them (a dataset's `element_spec` without its targets).

    Returns:
        `{"shape": [...], "dtype": ...}` in place of each spec (`None` for a
        dimension of unknown size); `None` if the spec is of another kind.
    """
    try:
        return tf.nest.map_structure(
            lambda leaf: {"shape": leaf.shape.as_list(), "dtype": leaf.dtype.name}, spec
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _describe_loss(loss: Any) -> str:
    """A loss as the result names it: its class's name, its function's, or the identifier."""
    if isinstance(loss, keras.losses.Loss):
        return type(loss).__name__
    return getattr(loss, "__name__", str(loss))


def _json_ready(value: Any) -> Any:
    """`value` with what JSON cannot hold (a NumPy integer a data factory declared) made plain."""

    def plain(item: Any) -> Any:
        return item.tolist() if hasattr(item, "tolist") else str(item)

    return json.loads(json.dumps(value, default=plain))

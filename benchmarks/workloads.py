"""What `mpt-bench` trains: a reference model on synthetic batches, or a run config's own.

A `Workload` builds its model with the same initial weights and gives the same
batches at every call, so that every variant of it starts and trains alike.
A config's model, data and loss come through the run assembly, as `mpt-train`
makes them; its model is built once in float32 (the user's errors in one
line, before anything is measured) and its weights start every variant. A
`model.file`'s layers keep the policies they were saved with, so each variant
first gives them the global one, as if built under it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

import keras

from benchmarks import harness
from mpt_keras import models
from mpt_keras.config import TrainConfig
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.runs import precision_plan, resolution

LANGUAGE_MODEL = "transformer_lm"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model the suite measures, with its data and loss.

    Attributes:
        name: Its name in the variants' names.
        build: Returns the model, in the current global dtype policy, with the
            same initial weights at every call.
        batches: Returns its endless stream of full train batches, the same at every
            call: a `tf.data.Dataset`, or on JAX an iterable of NumPy batches.
        tokens_per_example: Of a sequence model (for tokens per second), else `None`.
        description: What the result's `models` says about it (JSON-ready).
    """

    name: str
    build: Callable[[], keras.Model]
    batches: Callable[[], Any]
    loss: Any
    batch_size: int
    tokens_per_example: int | None
    description: Mapping[str, Any]


def reference(
    name: str, batch_size: int, sequence_length: int, num_layers: int, d_model: int
) -> Workload:
    """The reference model `name` on synthetic batches (`harness`).

    `batch_size` is in sequences for the Transformer LM, in images otherwise.
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
    """The model, data and loss of the resolved run `config`, named `name` in the result.

    Raises:
        UserInputError: For a component that cannot be resolved, loaded or
            built (here, before anything is measured).
    """
    components = resolution.resolve_components(config)
    data = components.data()
    float32 = dataclasses.replace(config, precision="float32", manifest=None)
    model, _, _ = precision_plan.build_model(float32, components, data)
    initial_weights = model.get_weights()
    parameters = model.count_params()
    del model

    def build() -> keras.Model:
        keras.utils.set_random_seed(config.seed)
        built = components.model(**data.dimensions)
        precision_plan.build_on_data(built, data)  # As the run assembly builds it.
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
    inputs = harness.input_spec(batches())
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
    """`{"shape": [...], "dtype": ...}` in place of each leaf of a batch's input spec (a
    `tf.TensorSpec`, or anything with a shape and dtype), nested as it is; `None` for a spec
    of another kind."""
    try:
        return keras.tree.map_structure(
            lambda leaf: {
                "shape": list(leaf.shape),
                "dtype": keras.backend.standardize_dtype(leaf.dtype),
            },
            spec,
        )
    except (AttributeError, TypeError, ValueError):
        return None


def _describe_loss(loss: Any) -> str:
    """A loss's class's name, its function's, or the identifier."""
    if isinstance(loss, keras.losses.Loss):
        return type(loss).__name__
    return getattr(loss, "__name__", str(loss))


def _json_ready(value: Any) -> Any:
    """`value` with what JSON cannot hold (a factory's NumPy integers) made plain."""

    def plain(item: Any) -> Any:
        return item.tolist() if hasattr(item, "tolist") else str(item)

    return json.loads(json.dumps(value, default=plain))

"""Layer paths: the path of every layer of a model, and the forms a rule's path is tried in.

A layer's path is the layer names from the model down, joined by "/" (Keras' `layer.path`
in a functional or loaded model). Keras gives none to a layer without a build step (Softmax,
Dropout), and the name it makes up (`softmax_3`) depends on how many were made before; so such
a layer, held by a layer that is not a model, is named by the attribute holding it
(`.../self_attention/_softmax`). Names given on purpose, or in a list or dict, are kept.

A manifest rule's path is tried against each form (`LayerPath.forms`; examples in
docs/precision.md, "Path forms"):

    1. the path from the model the manifest is applied to;
    2. the path below each nested model holding the layer (Keras' path there);
    3. each of those with that model's name in front (Keras' path in a Sequential or
       subclassed model built by calling it);
    4. each of those with every model name Keras made up (`gpt2_backbone_1`) read as its
       first instance's (`gpt2_backbone`), so one manifest serves every instance;
    5. `layer.path` itself, if Keras gave one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

import keras

from mpt_keras import compat


@dataclasses.dataclass(frozen=True)
class LayerPath:
    """A layer, its path from the model walked, and `models`: `(path, model)` of each model
    holding it, the model walked first (path `""`), innermost last.

    Example:

        entry = next(iter_layer_paths(keras.Sequential([keras.layers.Dense(2)], name="mlp")))
        entry.path, entry.forms  # ('dense', ('dense', 'mlp/dense'))
    """

    path: str
    layer: Any
    models: tuple[tuple[str, keras.Model], ...]

    @functools.cached_property
    def forms(self) -> tuple[str, ...]:
        """The forms a rule's path is tried against, without repeats (see the module)."""
        segments = self.path.split("/")
        canonical = list(segments)
        for model_path, model in self.models[1:]:
            canonical[model_path.count("/")] = first_instance_name(model)
        forms = []
        for model_path, model in self.models:
            start = model_path.count("/") + 1 if model_path else 0
            names = dict.fromkeys((model.name, first_instance_name(model)))
            for parts in (segments, canonical):
                below = "/".join(parts[start:])
                forms.append(below)
                forms.extend(f"{name}/{below}" for name in names)
        if getattr(self.layer, "path", None):
            forms.append(self.layer.path)
        return tuple(dict.fromkeys(forms))


def iter_layers(layer: keras.layers.Layer, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields `(path, layer)` for every sublayer of `layer`, depth first, `prefix` in front."""
    for path, child in _children(layer, prefix):
        yield path, child
        yield from iter_layers(child, prefix=path + "/")


def iter_layer_paths(model: keras.Model) -> Iterator[LayerPath]:
    """Yields every layer of `model` with its path and the models holding it, depth first."""

    def walk(layer, prefix, models):
        for path, child in _children(layer, prefix):
            yield LayerPath(path, child, models)
            inner = (*models, (path, child)) if isinstance(child, keras.Model) else models
            yield from walk(child, path + "/", inner)

    yield from walk(model, "", (("", model),))


def first_instance_name(obj: Any) -> str:
    """`obj`'s name, or if Keras made it up, its first instance's (`gpt2_backbone` for
    `gpt2_backbone_1`)."""
    return _snake_case(type(obj).__name__) if _has_keras_name(obj) else obj.name


def _children(layer, prefix: str) -> Iterator[tuple[str, Any]]:
    for child in compat.direct_sublayers(layer):
        if not isinstance(child, keras.layers.InputLayer):
            yield prefix + _child_name(layer, child), child


def _child_name(parent, child) -> str:
    """`child.name`, or the attribute of `parent` holding it (see the module)."""
    pathless = child.built and child.path is None
    if isinstance(parent, keras.Model) or not pathless or not _has_keras_name(child):
        return child.name
    for attribute, value in vars(parent).items():
        if value is child:
            return attribute
    return child.name


def _has_keras_name(obj) -> bool:
    """Whether `obj.name` is one Keras made up from its class (`softmax`, `softmax_3`)."""
    return (
        re.fullmatch(re.escape(_snake_case(type(obj).__name__)) + r"(_\d+)?", obj.name) is not None
    )


@functools.lru_cache(maxsize=None)
def _snake_case(name: str) -> str:
    # As Keras' own `keras.src.utils.naming.to_snake_case`, which names layers.
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()

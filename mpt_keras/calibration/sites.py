"""Calibration sites: each layer a rule can name (`layer_paths`), at its first path, keras_hub
blocks' own sublayers included; functional and Sequential models only run layers and are none.
A container's decision covers only its own ops: Keras never passes a policy to a built sublayer.

Ties (`Group`): a block adding a sublayer's output to its residual with TF's one-dtype `+` must
compute in that sublayer's dtype. Found by trial: the container is called with the sublayer
alone in float16; if that raises, they are tied, and (transitively) measured and decided as one.
A normalization is tied to nothing: a manifest hands its output back in the dtype of the block
calling it (`precision/hand_back.py`), so a post-norm block (BERT's) may compute in float16
around its float32 norms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mpt_keras import compat
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.keras_bridge.layer_paths import iter_layer_paths
from mpt_keras.precision.decisions import is_normalization

_IDENTITY_AT_INFERENCE = (
    keras.layers.Dropout,  # SpatialDropout1D to 3D derive from it.
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
    keras.layers.ActivityRegularization,
    keras.layers.Identity,
)
_ELEMENTWISE = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.Activation)
_SUMMING_ACTIVATIONS = ("softmax", "log_softmax")
_MOVES_DATA = (
    keras.layers.Reshape,
    keras.layers.Flatten,
    keras.layers.Permute,
    keras.layers.RepeatVector,
    keras.layers.Cropping1D,
    keras.layers.Cropping2D,
    keras.layers.Cropping3D,
    keras.layers.ZeroPadding1D,
    keras.layers.ZeroPadding2D,
    keras.layers.ZeroPadding3D,
)


def _dtype_errors() -> tuple[type[Exception], ...]:
    """Raised where a sublayer's output meets the container's tensors in a one-dtype op: also
    TensorFlow's op errors when it runs."""
    tensorflow = sys.modules.get("tensorflow")
    return (TypeError, ValueError) + ((tensorflow.errors.OpError,) if tensorflow else ())


@dataclasses.dataclass(eq=False)
class Site:
    """A decided layer and each call's `(args, kwargs, outputs)`; `path` "" for a calibrated
    subclassed model (a site only for its sublayers' ties)."""

    path: str
    layer: keras.layers.Layer
    calls: list[tuple[tuple, dict, Any]] = dataclasses.field(default_factory=list)

    def outputs(self) -> list[np.ndarray]:
        """Each call's floating outputs, flat, in float32."""
        return [flat_float32(keras.tree.flatten(outputs)) for _, _, outputs in self.calls]


@dataclasses.dataclass(frozen=True)
class Group:
    """Sites that must compute in one dtype (an untied site alone); `members` in site order.

    `called`: the outermost, called to measure the group with every member low.
    """

    called: Site
    members: tuple[Site, ...]

    @property
    def lead(self) -> Site:
        """The member whose decision the others follow."""
        return self.members[0]


class CalibrationSites:
    """The sites of a built model, their calls and ties: run the model in `recording()`, then
    `groups()`."""

    def __init__(self, model: keras.Model):
        self.sites: list[Site] = []
        self._by_id: dict[int, Site] = {}
        for entry in iter_layer_paths(model):
            if id(entry.layer) not in self._by_id and not _has_graph(entry.layer):
                self._by_id[id(entry.layer)] = Site(entry.path, entry.layer)
                self.sites.append(self._by_id[id(entry.layer)])
        self._root = None if _has_graph(model) else Site("", model)
        self._containers = [
            site for site in (self._root, *self.sites) if site is not None and self._children(site)
        ]

    def recording(self) -> contextlib.AbstractContextManager:
        """Records each call of every site and container while the block runs."""
        watched = {id(site.layer): site for site in (*self.sites, *self._containers)}
        return calls_wrapped(
            (site.layer for site in watched.values()),
            lambda layer, call: _recording(watched[id(layer)], call),
        )

    def groups(self) -> list[Group]:
        """Every site in its group, the groups in site order.

        Call after `recording`, every layer float32: each container reruns its first call
        once per called sublayer.
        """
        order = {id(site): index for index, site in enumerate((self._root, *self.sites)) if site}
        leader = {key: key for key in order}  # Union-find, by id.

        def find(key: int) -> int:
            while leader[key] != key:
                key = leader[key]
            return key

        for container in self._containers:
            for child in self._children(container):
                # A sublayer not called makes no tensor to meet another.
                if not container.calls or not child.calls or is_normalization(child.layer):
                    continue
                if _tied(container, child):
                    first, second = sorted((find(id(container)), find(id(child))), key=order.get)
                    leader[second] = first
        members: dict[int, list[Site]] = {}
        for site in self.sites:
            members.setdefault(find(id(site)), []).append(site)
        everyone = {id(site): site for site in (self._root, *self.sites) if site}
        return [Group(everyone[key], tuple(group)) for key, group in members.items()]

    def holds_sites(self, site: Site) -> bool:
        """Whether `site` is a container (holds sites)."""
        return bool(self._children(site))

    def _children(self, site: Site) -> list[Site]:
        """The sites `site`'s layer tracks directly (not a graph model's layers)."""
        return [
            self._by_id[id(layer)]
            for layer in compat.direct_sublayers(site.layer)
            if id(layer) in self._by_id
        ]


def pass_through_reason(layer: keras.layers.Layer) -> str | None:
    """Why `layer` is not worth measuring, or None.

    Its low-precision error would be its inputs' rounding only: the identity at inference
    (`training=False`), elementwise without a sum, or moving data. Its range decides it.
    """
    name = type(layer).__name__
    if isinstance(layer, _IDENTITY_AT_INFERENCE):
        return f"{name}: the identity at inference"
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if isinstance(layer, _ELEMENTWISE) and activation not in _SUMMING_ACTIVATIONS:
        return f"{name}: elementwise"
    if isinstance(layer, _MOVES_DATA):
        return f"{name}: moves data"
    return None


def flat_float32(tensors: list[Any]) -> np.ndarray:
    """The floating tensors of `tensors`, flat and concatenated, in float32."""
    pieces = [
        np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32"))).ravel()
        for tensor in tensors
        if keras.backend.is_float_dtype(tensor.dtype)
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _has_graph(layer: keras.layers.Layer) -> bool:
    return isinstance(layer, keras.Model) and layer.built and bool(getattr(layer, "outputs", None))


def _tied(container: Site, child: Site) -> bool:
    """Whether `container`'s first recorded call raises with `child` alone in float16."""
    args, kwargs, _ = container.calls[0]
    policy = child.layer.dtype_policy
    compat.replace_dtype_policy(child.layer, keras.DTypePolicy("mixed_float16"))
    try:
        container.layer(*args, **kwargs)
    except _dtype_errors():
        return True
    finally:
        compat.replace_dtype_policy(child.layer, policy)
    return False


def _recording(site: Site, call: Callable[..., Any]) -> Callable[..., Any]:
    def recording_call(*args, **kwargs):
        outputs = call(*args, **kwargs)
        site.calls.append((args, kwargs, outputs))
        return outputs

    return recording_call

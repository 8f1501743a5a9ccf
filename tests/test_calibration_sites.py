"""Tests of mpt_keras.calibration.sites: which layers calibration decides, and their ties."""

import keras
import numpy as np
import pytest
from toy_layers import Residual, Times

from mpt_keras.calibration.sites import CalibrationSites, pass_through_reason

FEATURES = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")


def _recorded(model: keras.Model) -> CalibrationSites:
    sites = CalibrationSites(model)
    with sites.recording():
        model(FEATURES, training=False)
    return sites


class Pair(keras.Model):
    """Adds its two sublayers' outputs with TensorFlow's `+` in its own call."""

    def __init__(self):
        super().__init__(name="pair")
        self.left = keras.layers.Dense(4, name="left")
        self.right = keras.layers.Dense(4, name="right")
        self.scale = Times(2.0, name="scale")

    def call(self, inputs):
        return self.scale(self.left(inputs) + self.right(inputs))


def test_sites_are_every_layer_at_its_first_path_but_graph_models():
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    inner = keras.Model(inputs, shared(inputs), name="inner")
    x = inner(inputs)
    x = Residual(1.0, name="residual")(shared(x))
    model = keras.Model(inputs, x, name="outer")

    sites = CalibrationSites(model)

    # inner, a graph of layers, is no site; shared, at two paths, is one.
    assert [site.path for site in sites.sites] == [
        "inner/shared",
        "residual",
        "residual/norm",
        "residual/inner",
    ]
    assert [sites.holds_sites(site) for site in sites.sites] == [False, True, False, False]


def test_a_sublayer_whose_output_meets_its_containers_tensors_is_tied_to_it():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, Residual(1.0, name="residual")(inputs))
    sites = _recorded(model)

    groups = sites.groups()

    assert [(group.called.path, [member.path for member in group.members]) for group in groups] == [
        ("residual", ["residual", "residual/inner"]),
        ("residual/norm", ["residual/norm"]),
    ]
    assert groups[0].lead.path == "residual"
    # Each site recorded its call; the trials leave every policy float32.
    assert [len(site.calls) for site in sites.sites] == [1, 1, 1]
    assert {layer.dtype_policy.name for layer in model.layers} == {"float32"}


def test_sublayers_tied_by_a_subclassed_models_own_call_are_one_group_called_through_it():
    model = Pair()
    model(FEATURES)
    sites = _recorded(model)

    groups = sites.groups()

    # The model itself is no site: called for the group, it is not a member.
    assert [(group.called.path, [member.path for member in group.members]) for group in groups] == [
        ("", ["left", "right"]),
        ("scale", ["scale"]),
    ]
    assert groups[0].called.layer is model


@pytest.mark.parametrize(
    "layer, reason",
    [
        (keras.layers.Dropout(0.1), "Dropout: the identity at inference"),
        (keras.layers.SpatialDropout1D(0.1), "SpatialDropout1D: the identity at inference"),
        (keras.layers.GaussianNoise(0.1), "GaussianNoise: the identity at inference"),
        (keras.layers.ReLU(), "ReLU: elementwise"),
        (keras.layers.Activation("silu"), "Activation: elementwise"),
        (keras.layers.Reshape((2, 2)), "Reshape: moves data"),
        (keras.layers.ZeroPadding2D(), "ZeroPadding2D: moves data"),
        (keras.layers.Activation("softmax"), None),
        (keras.layers.Softmax(), None),
        (keras.layers.Dense(2), None),
        (keras.layers.Add(), None),
    ],
    ids=[
        "dropout",
        "spatial_dropout",
        "gaussian_noise",
        "relu",
        "activation_silu",
        "reshape",
        "zero_padding",
        "activation_softmax",
        "softmax",
        "dense",
        "add",
    ],  # fmt: skip
)
def test_pass_through_layers_are_those_whose_error_is_their_inputs_rounding(layer, reason):
    assert pass_through_reason(layer) == reason

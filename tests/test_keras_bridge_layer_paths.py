"""Tests of mpt_keras.keras_bridge.layer_paths: the paths of a model's layers, and their forms."""

import keras

from mpt_keras import models
from mpt_keras.keras_bridge.layer_paths import first_instance_name, iter_layer_paths, iter_layers
from mpt_keras.precision.report import precision_report


class _Holder(keras.layers.Layer):
    """Holds layers without a build step: by attribute, named on purpose, in a list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.act = keras.layers.Activation("gelu")
        self.gate = keras.layers.Activation("sigmoid", name="gate")
        self.pool = [keras.layers.Activation("relu")]

    def call(self, inputs):
        return self.pool[0](self.gate(self.act(inputs)))


def test_layers_keras_gives_no_path_are_named_by_their_attribute_in_every_instance():
    first, second = _Holder(name="first"), _Holder(name="second")
    assert [layer.name for layer in second._flatten_layers(include_self=False)] == [
        "activation_2",
        "gate",
        "activation_3",
    ]
    assert [path for path, _ in iter_layers(first, prefix="first/")] == [
        "first/act",  # Keras' name "activation": the attribute instead
        "first/gate",  # named on purpose: kept
        "first/activation_1",  # in a list: no attribute holds it alone
    ]
    assert [path for path, _ in iter_layers(second)] == ["act", "gate", "activation_3"]


def test_attention_layers_made_for_themselves_are_named_by_attribute():
    # Another attention takes the names "softmax" and "dropout".
    keras.layers.MultiHeadAttention(2, 4).build((1, 3, 8), (1, 3, 8))
    model = models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 8, "num_heads": 2},
        vocab_size=16,
        sequence_length=4,
    )
    layers = dict(iter_layers(model))
    softmax = layers["block_0/attention/_softmax"]
    dropout = layers["block_0/attention/_dropout_layer"]
    assert (softmax.name, dropout.name) == ("softmax_1", "dropout_1")
    assert [entry.path for entry in precision_report(model).layers][8:10] == [
        "block_0/attention/_softmax",
        "block_0/attention/_dropout_layer",
    ]
    # A layer with a build step keeps its name: Keras' own path.
    assert layers["block_0/attention/query"].path == "block_0/attention/query"


def test_path_forms_of_a_layer_of_a_wrapped_backbone(tiny_gpt2):
    def gpt2():
        return tiny_gpt2(num_layers=1)

    gpt2()  # Takes the name "gpt2_backbone".
    first_wrapper_inputs = keras.Input((1,))
    keras.Model(first_wrapper_inputs, first_wrapper_inputs)  # Takes "functional".
    backbone = gpt2()
    wrapper = keras.Model(backbone.input, backbone(backbone.input))
    assert (backbone.name, wrapper.name) == ("gpt2_backbone_1", "functional_1")

    entries = {entry.path: entry for entry in iter_layer_paths(wrapper)}
    query = entries["gpt2_backbone_1/transformer_layer_0/self_attention/query"]
    assert query.forms == (
        "gpt2_backbone_1/transformer_layer_0/self_attention/query",
        "functional_1/gpt2_backbone_1/transformer_layer_0/self_attention/query",
        "functional/gpt2_backbone_1/transformer_layer_0/self_attention/query",
        "gpt2_backbone/transformer_layer_0/self_attention/query",
        "functional_1/gpt2_backbone/transformer_layer_0/self_attention/query",
        "functional/gpt2_backbone/transformer_layer_0/self_attention/query",
        "transformer_layer_0/self_attention/query",  # below the backbone: Keras' path
    )
    assert query.layer.path == "transformer_layer_0/self_attention/query"
    assert [(path, model.name) for path, model in query.models] == [
        ("", "functional_1"),
        ("gpt2_backbone_1", "gpt2_backbone_1"),
    ]
    softmax = entries["gpt2_backbone_1/transformer_layer_0/self_attention/_softmax"]
    assert softmax.layer.path is None
    assert softmax.forms[-1] == "transformer_layer_0/self_attention/_softmax"


def test_first_instance_name_undoes_only_the_numbering_keras_makes_up():
    class TinyClassifier(keras.Model):
        def call(self, inputs):
            return inputs

    TinyClassifier()
    assert [first_instance_name(model) for model in (TinyClassifier(), keras.Sequential())] == [
        "tiny_classifier",
        "sequential",
    ]
    assert first_instance_name(TinyClassifier(name="tiny_classifier_9")) == "tiny_classifier"
    assert first_instance_name(keras.Sequential(name="mlp_1")) == "mlp_1"

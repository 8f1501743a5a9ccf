"""Tests of mpt_keras.models: shapes, stable layer paths, strict options."""

import keras
import numpy as np
import pytest

from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_image_models_map_images_to_class_logits(name):
    model = models.build_model(name, {}, input_shape=(8, 8, 1), num_classes=10)
    assert model(np.zeros((3, 8, 8, 1), "float32")).shape == (3, 10)
    assert models.model_task(name) == models.CLASSIFICATION
    assert model.layers[-1].name == "logits"


def test_transformer_maps_tokens_to_next_token_logits():
    model = models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 16, "num_heads": 2},
        vocab_size=256,
        sequence_length=12,
    )
    assert model(np.zeros((2, 12), "int32")).shape == (2, 12, 256)
    assert models.model_task("transformer_lm") == models.LANGUAGE_MODEL


def test_transformer_layer_paths_are_stable():
    model = models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 16, "num_heads": 2},
        vocab_size=256,
        sequence_length=12,
    )
    paths = [path for path, _ in iter_layers(model)]
    assert paths == [
        "token_embedding",
        "position_embedding",
        "block_0",
        "block_0/attention_norm",
        "block_0/attention",
        "block_0/attention/query",
        "block_0/attention/key",
        "block_0/attention/value",
        "block_0/attention/_softmax",
        "block_0/attention/_dropout_layer",
        "block_0/attention/attention_output",
        "block_0/mlp_norm",
        "block_0/mlp_up",
        "block_0/mlp_down",
        "block_0/mlp_dropout",
        "final_norm",
        "logits",
    ]
    # Layers with weights: our paths are Keras' own.
    for path, layer in iter_layers(model):
        if layer.weights:
            assert layer.path == path


def test_transformer_is_causal():
    model = models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 16, "num_heads": 2},
        vocab_size=256,
        sequence_length=8,
    )
    tokens = np.arange(8, dtype="int32")[None]
    changed = tokens.copy()
    changed[0, 5] = 200
    before, after = model(tokens), model(changed)
    np.testing.assert_array_equal(before[0, :5], after[0, :5])
    assert not np.allclose(before[0, 5:], after[0, 5:])


def test_transformer_survives_save_and_load(tmp_path):
    model = models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 16, "num_heads": 2},
        vocab_size=256,
        sequence_length=8,
    )
    path = str(tmp_path / "lm.keras")
    model.save(path)
    tokens = np.arange(8, dtype="int32")[None]
    np.testing.assert_allclose(keras.saving.load_model(path)(tokens), model(tokens), rtol=1e-6)


def test_unknown_model():
    with pytest.raises(UserInputError) as raised:
        models.build_model("resnet", {}, input_shape=(8, 8, 1), num_classes=10)
    assert str(raised.value) == (
        "key 'model.name': received 'resnet'. Allowed: mlp, cnn, transformer_lm"
    )


def test_unknown_option():
    with pytest.raises(UserInputError) as raised:
        models.build_model("cnn", {"width": 3}, input_shape=(8, 8, 1), num_classes=10)
    assert str(raised.value) == (
        "unknown option 'model.options.width' for model 'cnn'. "
        "Allowed: filters, dense_units, dropout"
    )


def test_bad_option_value():
    with pytest.raises(UserInputError) as raised:
        models.build_model(
            "transformer_lm", {"d_model": 10, "num_heads": 4}, vocab_size=256, sequence_length=8
        )
    assert str(raised.value) == (
        "model 'transformer_lm' cannot be built from model.options: d_model must be divisible "
        "by num_heads. Received: d_model=10, num_heads=4"
    )


def test_every_model_name_of_the_config_has_a_builder():
    assert tuple(models._MODELS) == models.MODEL_NAMES

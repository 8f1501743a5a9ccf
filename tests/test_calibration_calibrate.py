"""Tests of mpt_keras.calibration.calibrate: statistics, decisions with reasons, the manifest."""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from toy_layers import PostNormBlock, Residual, Times

from examples.user_models import backbone_with_head
from mpt_keras import PrecisionManifest, Rule, UserInputError
from mpt_keras.calibration.calibrate import calibrate
from mpt_keras.calibration.decisions import CalibrationThresholds
from mpt_keras.calibration.result import format_calibration_table
from mpt_keras.precision.hand_back import hand_back_of

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DATA_ALLOWED = (
    "Allowed: a tf.data.Dataset or another iterable of (x, y) or (x, y, sample_weight) "
    "batches, or a tuple (x, y) or (x, y, sample_weight) of arrays; x an array or a dict of "
    "arrays"
)
LOSS_ALLOWED = (
    "Allowed: a keras.losses.Loss, a name of one, a function loss(y_true, y_pred), or a dict "
    "or list of those per output"
)
MODEL_ALLOWED = "Allowed: a keras.Model, or a function of no arguments returning one"


class Block(keras.layers.Layer):
    """A nested unit: Dense then LayerNormalization, scaled by `factor`."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
        self.inner = keras.layers.Dense(4, name="inner", dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization(name="norm", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.norm.build(input_shape[:-1] + (4,))

    def call(self, inputs):
        return self.norm(self.inner(inputs)) * self.factor


def _data(examples=64, features=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(examples, features)).astype("float32"),
        rng.integers(0, 3, examples),
    )


def _model(*middle):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, kernel_initializer="ones", name="first")(inputs)
    for layer in middle:
        x = layer(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


def test_a_layer_beyond_the_float16_range_gets_bfloat16_with_the_range_as_reason():
    model = _model(
        keras.layers.Dense(4, kernel_initializer="ones", name="hidden"), Times(1e5, name="big")
    )
    features, labels = _data()
    result = calibrate(model, (features, labels), LOSS, steps=2, batch_size=32)

    layers = result.statistics["layers"]
    # Every example is used once (64 = 2 x 32): first sums the 4 features,
    # hidden sums the 4 equal sums, big multiplies by 1e5.
    expected_max = float(np.max(np.abs(features.sum(axis=1) * 4 * 1e5)))
    assert layers["big"]["activations"]["max"] == pytest.approx(expected_max, rel=1e-6)
    assert layers["big"]["activations"]["above_float16_max_fraction"] == pytest.approx(
        np.mean(np.abs(features.sum(axis=1) * 4 * 1e5) > 65504), abs=1e-9
    )
    assert layers["big"]["errors"]["mixed_float16"] == "inf"  # inf in float16, as JSON writes it
    assert layers["big"]["errors"]["mixed_bfloat16"] < 5e-3
    assert layers["big"]["reason"] == (
        f"activation max {expected_max:.3g} > 8188 (float16 max 65504 / headroom 8) "
        "-> mixed_bfloat16"
    )
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "first": "mixed_float16",
        "hidden": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }
    assert layers["logits"]["reason"] == "safe default: model output"
    assert result.manifest == PrecisionManifest(
        "mixed_float16", (Rule("mixed_bfloat16", path="big", reason=layers["big"]["reason"]),)
    )
    assert result.manifest.apply(model).policies == {
        "first": "mixed_float16",
        "hidden": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }


def _output_as_loss(y_true, y_pred):
    """The model's output as each example's loss: gradients known by construction."""
    del y_true
    return y_pred[:, 0]


def _probe_model(downstream):
    """`probe`, a Dense(2), then `logits` summing its outputs times `downstream`.

    With `_output_as_loss`, the gradient of probe's kernel is the mean input
    times `downstream` in both columns, and of its bias `downstream`.
    """
    inputs = keras.Input((2,))
    probe = keras.layers.Dense(2, kernel_initializer="ones", name="probe")(inputs)
    logits = keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(downstream),
        trainable=False,
        name="logits",
    )(probe)
    return keras.Model(inputs, logits)


@pytest.mark.parametrize(
    "row, initial_scale, kernel, bias, layer, policy, reason",
    [
        # Kernel gradient [[d, d], [1e3 d, 1e3 d]], bias gradient [d, d], d = 1e-12:
        # at 2**15 d flushes (3.3e-8 < 6e-8), 1e3 d does not. The bias loses
        # all of its tiny gradient and the layer almost nothing:
        # sqrt(2 d**2 + 2 d**2) / sqrt(4 d**2 + 2e6 d**2).
        (
            [1.0, 1e3],
            2.0**15,
            1 / np.sqrt(1 + 1e6),
            1.0,
            2 / np.sqrt(4 + 2e6),
            "mixed_float16",
            "range fits float16, error 0 <= 0.01 -> mixed_float16",
        ),
        # Every entry d: the whole gradient flushes, unless the scale is 2**40.
        (
            [1.0, 1.0],
            2.0**15,
            1.0,
            1.0,
            1.0,
            "mixed_bfloat16",
            "gradient x 32768: 100% of its norm flushes to zero in float16 "
            "(below 6e-08; > 1%) -> mixed_bfloat16",
        ),
        (
            [1.0, 1.0],
            2.0**40,
            0.0,
            0.0,
            0.0,
            "mixed_float16",
            "range fits float16, error 0 <= 0.01 -> mixed_float16",
        ),
    ],
    ids=["tiny_entries_lose_nothing", "all_flushed", "all_kept_at_2**40"],
)
def test_gradient_flushing_counts_the_norm_lost(
    row, initial_scale, kernel, bias, layer, policy, reason
):
    model = _probe_model(downstream=1e-12)
    features = np.array([row] * 4, "float32")
    result = calibrate(
        model, (features, np.zeros(4)), _output_as_loss, steps=1, initial_scale=initial_scale
    )

    gradients = result.statistics["gradients"]
    d = float(np.float32(1e-12))
    assert gradients["probe/kernel"]["norm"] == pytest.approx(d * np.sqrt(2 + 2 * row[1] ** 2))
    assert gradients["probe/bias"]["norm"] == pytest.approx(d * np.sqrt(2))
    assert gradients["probe/kernel"]["flushed_norm_fraction"] == pytest.approx(kernel)
    assert gradients["probe/bias"]["flushed_norm_fraction"] == pytest.approx(bias)
    assert gradients["probe/kernel"]["nonzero_fraction"] == 1.0
    assert gradients["probe/kernel"]["overflow_fraction"] == 0.0
    probe = result.statistics["layers"]["probe"]
    assert probe["gradients"]["flushed_norm_fraction"] == pytest.approx(layer)
    assert (probe["policy"], probe["reason"]) == (policy, reason)
    assert set(result.statistics["gradients"]) == {"probe/kernel", "probe/bias"}


def test_activations_flushing_counts_the_norm_lost():
    # first sums the 4 features: 4e-4 or 4 per example; shrink's outputs 4e-8
    # (below 6e-8: flushed in float16) or 4e-4 (a float16 normal number).
    model = _model(Times(1e-4, name="shrink"))
    features = np.ones((4, 4), "float32")
    features[::2] = 1e-4
    data = (features, np.zeros(4))
    result = calibrate(model, data, LOSS, steps=1, batch_size=4)

    shrink = result.statistics["layers"]["shrink"]
    assert shrink["activations"]["below_subnormal_fraction"] == 0.5  # Half the values...
    flushed = shrink["activations"]["flushed_norm_fraction"]
    assert flushed == pytest.approx(1 / np.sqrt(1 + 1e8), rel=1e-5)
    assert shrink["policy"] == "mixed_float16"  # ...but 1e-4 of the norm: nothing lost.
    strict = CalibrationThresholds(max_flushed_norm_fraction=1e-5)
    shrink = calibrate(model, data, LOSS, steps=1, batch_size=4, thresholds=strict).statistics[
        "layers"
    ]["shrink"]
    assert shrink["reason"] == (
        "activations: 0.01% of their norm flushes to zero in float16 "
        "(below 6e-08; > 0.001%) -> mixed_bfloat16"
    )


@pytest.mark.parametrize(
    "loss",
    [_output_as_loss, keras.losses.MeanAbsoluteError()],
    ids=["function", "keras_loss"],
)
@pytest.mark.parametrize("source", ["dataset", "arrays"])
def test_sample_weights_weigh_the_gradients(loss, source):
    # Two examples, [1, 0] and [0, 1], weights 1 and 0. The mean absolute error
    # from -10 is the output plus 10: the same gradients as the output alone.
    model = _probe_model(downstream=1.0)
    features = np.eye(2, dtype="float32")
    labels = np.full((2, 1), -10.0, "float32")
    weights = np.array([1.0, 0.0], "float32")

    def gradients(*data):
        if source == "dataset":
            data = tf.data.Dataset.from_tensor_slices(data).batch(2)
        result = calibrate(model, data, loss, steps=1, batch_size=2)
        return {path: figures["norm"] for path, figures in result.statistics["gradients"].items()}

    # Weighted, the loss is the first example's output / 2: kernel gradient
    # [[0.5, 0.5], [0, 0]], bias gradient [0.5, 0.5].
    assert gradients(features, labels, weights) == {
        "probe/kernel": pytest.approx(np.sqrt(0.5)),
        "probe/bias": pytest.approx(np.sqrt(0.5)),
    }
    assert gradients(features, labels) == {
        "probe/kernel": pytest.approx(1.0),
        "probe/bias": pytest.approx(np.sqrt(2.0)),
    }


def _two_outputs(structure):
    """`_probe_model`'s logits (downstream 1) as two outputs, in a dict or a list."""
    inner = _probe_model(downstream=1.0)
    inputs = keras.Input((2,))
    logits = inner(inputs)
    outputs = {"a": logits, "b": logits * 3.0} if structure == "dict" else [logits, logits * 3.0]
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize(
    "structure, loss",
    [
        ("dict", {"a": _output_as_loss, "b": "mean_absolute_error"}),
        ("dict", _output_as_loss),
        ("list", [_output_as_loss, keras.losses.MeanAbsoluteError()]),
    ],
    ids=["dict", "one_for_all", "list"],
)
def test_a_model_of_several_outputs_sums_their_losses(structure, loss):
    # The output, then (3 x output) + 10 as loss of both outputs: the gradients of
    # `_probe_model`'s 1 + 3 times. `_output_as_loss` for all: 1 + 3 too.
    features = np.tile(np.eye(2, dtype="float32"), (2, 1))
    targets = np.full((4, 1), -10.0, "float32")
    labels = {"a": targets, "b": targets} if structure == "dict" else (targets, targets)
    result = calibrate(_two_outputs(structure), (features, labels), loss, steps=1, batch_size=4)
    norms = {path: figures["norm"] for path, figures in result.statistics["gradients"].items()}
    assert norms == {
        "probe/kernel": pytest.approx(4.0),
        "probe/bias": pytest.approx(4.0 * np.sqrt(2.0)),
    }


def test_each_head_a_subclassed_model_returns_keeps_float32_as_a_model_output():
    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__(name="two_heads")
            self.hidden = keras.layers.Dense(4, name="hidden")
            self.first = keras.layers.Dense(2, name="first")  # Not its last layer.
            self.second = keras.layers.Dense(2, name="second")

        def call(self, inputs):
            features = self.hidden(inputs)
            return {"a": self.first(features), "b": self.second(features)}

    features = np.random.default_rng(0).normal(size=(4, 2)).astype("float32")
    labels = {"a": features, "b": features}
    result = calibrate(TwoHeads(), (features, labels), "mean_squared_error", steps=1, batch_size=4)
    layers = result.statistics["layers"]
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "hidden": "mixed_float16",
        "first": "float32",
        "second": "float32",
    }
    assert layers["first"]["reason"] == layers["second"]["reason"] == "safe default: model output"


def test_a_factory_is_called_once_for_the_model():
    built = []

    def factory():
        keras.utils.set_random_seed(0)  # The initializers' seeds are drawn when made.
        built.append(_model(keras.layers.Dense(4, name="hidden")))
        return built[-1]

    from_factory = calibrate(factory, _data(), LOSS, steps=1)
    from_model = calibrate(factory(), _data(), LOSS, steps=1)

    assert len(built) == 2  # One by calibrate, one here.
    assert from_factory.statistics["model"] == built[0].name
    assert from_factory.statistics["layers"] == from_model.statistics["layers"]
    assert from_factory.manifest == from_model.manifest


def test_a_wrapped_keras_hub_backbone_is_decided_down_to_its_blocks_sublayers(tiny_gpt2):
    built = []

    def causal_lm():
        # As keras_hub's GPT2CausalLM: the token embedding also gives the logits.
        backbone = tiny_gpt2()
        built.append(backbone)
        logits = backbone.token_embedding(backbone(backbone.input), reverse=True)
        return keras.Model(backbone.input, logits, name="causal_lm")

    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 8)).astype("int32")
    features = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    dataset = tf.data.Dataset.from_tensor_slices((features, np.roll(tokens, -1, axis=1)))
    result = calibrate(causal_lm, dataset.batch(4), LOSS, steps=2)

    layers = result.statistics["layers"]
    block = {
        path.removeprefix("gpt2_backbone/transformer_layer_0/"): (layer["class"], layer["policy"])
        for path, layer in layers.items()
        if path.startswith("gpt2_backbone/transformer_layer_0/")
    }
    # The attention's softmax and dropout, which it makes for itself, by the
    # attributes holding them (`layer_paths`).
    assert block == {
        "self_attention": ("CachedMultiHeadAttention", "mixed_float16"),
        "self_attention/query": ("EinsumDense", "mixed_float16"),
        "self_attention/key": ("EinsumDense", "mixed_float16"),
        "self_attention/value": ("EinsumDense", "mixed_float16"),
        "self_attention/_softmax": ("Softmax", "mixed_float16"),
        "self_attention/_dropout_layer": ("Dropout", "mixed_float16"),
        "self_attention/attention_output": ("EinsumDense", "mixed_float16"),
        "self_attention_layer_norm": ("LayerNormalization", "float32"),
        "self_attention_dropout": ("Dropout", "mixed_float16"),
        "feedforward_intermediate_dense": ("Dense", "mixed_float16"),
        "feedforward_output_dense": ("Dense", "mixed_float16"),
        "feedforward_layer_norm": ("LayerNormalization", "float32"),
        "feedforward_dropout": ("Dropout", "mixed_float16"),
    }
    assert {path: layers[path]["policy"] for path in layers if path.count("/") == 1} == {
        "gpt2_backbone/token_embedding": "float32",
        "gpt2_backbone/position_embedding": "mixed_float16",
        "gpt2_backbone/embeddings_add": "mixed_float16",
        "gpt2_backbone/embeddings_dropout": "mixed_float16",
        "gpt2_backbone/transformer_layer_0": "mixed_float16",
        "gpt2_backbone/transformer_layer_1": "mixed_float16",
        "gpt2_backbone/layer_norm": "float32",
    }
    # The block adds both dropouts' outputs to its residual stream with `+`.
    assert layers["gpt2_backbone/transformer_layer_0"]["reason"].startswith(
        "own ops with tied self_attention_dropout, feedforward_dropout: range fits float16"
    )
    assert layers["gpt2_backbone/transformer_layer_0/feedforward_dropout"]["reason"] == (
        "tied to gpt2_backbone/transformer_layer_0 (they meet in an op of one dtype) "
        "-> mixed_float16"
    )
    assert layers["gpt2_backbone/transformer_layer_0/self_attention/_dropout_layer"]["reason"] == (
        "no compute worth measuring (Dropout: the identity at inference) -> the default "
        "mixed_float16"
    )
    # The token embedding was measured on both of its calls: the logits too.
    embedding = built[0].token_embedding
    lookups = embedding(tokens)
    logits = embedding(built[0](features), reverse=True)
    assert float(np.max(np.abs(logits))) > float(np.max(np.abs(lookups)))
    assert layers["gpt2_backbone/token_embedding"]["activations"]["max"] == pytest.approx(
        float(np.max(np.abs(logits)))
    )
    key = layers["gpt2_backbone/transformer_layer_0/self_attention/key"]
    key_bias = result.statistics["gradients"]["transformer_layer_0/self_attention/key/bias"]
    # Zero but for rounding: whatever of it flushes, the projection loses nothing.
    assert key_bias["layer"] == "gpt2_backbone/transformer_layer_0/self_attention/key"
    assert key_bias["flushed_norm_fraction"] > 0.1
    assert key_bias["norm"] < 1e-6 * key["gradients"]["norm"]
    assert key["gradients"]["flushed_norm_fraction"] < 1e-6
    assert result.manifest == PrecisionManifest("mixed_float16")


def _llama_with_head(
    tiny_llama, query_scale: float = 1.0, output_scale: float = 1.0
) -> keras.Model:
    """A tiny keras_hub LlamaBackbone under a Dense head; its first block's query and
    feed-forward output kernels times `query_scale` and `output_scale`."""
    keras.utils.set_random_seed(0)
    backbone = tiny_llama()
    model = backbone_with_head(backbone, vocab_size=64, sequence_length=8)
    for path, scale in (
        ("transformer_layer_0/self_attention/query", query_scale),
        ("transformer_layer_0/feedforward_output_dense", output_scale),
    ):
        kernel = next(v for v in backbone.weights if v.path == f"{path}/kernel")
        kernel.assign(kernel * scale)
    return model


def test_a_llama_block_is_decided_sublayer_by_sublayer_and_the_manifest_applies(tiny_llama):
    # query's outputs (2.8e4) and the feed-forward output's (1.4e4) are
    # beyond 65504 / 8, and so is the rotary embedding of the queries.
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 8)).astype("int32")
    features = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    data = (features, np.roll(tokens, -1, axis=1))
    result = calibrate(
        lambda: _llama_with_head(tiny_llama, query_scale=1e5, output_scale=1e7), data, LOSS, steps=1
    )

    layers = result.statistics["layers"]
    block = "llama_backbone/transformer_layer_0"
    assert {
        path.removeprefix(block): layer["policy"]
        for path, layer in layers.items()
        if path.startswith(block)
    } == {
        "": "mixed_bfloat16",
        "/self_attention": "mixed_float16",
        "/self_attention/query": "mixed_bfloat16",
        "/self_attention/key": "mixed_float16",
        "/self_attention/value": "mixed_float16",
        "/self_attention/attention_softmax": "mixed_float16",
        "/self_attention/_dropout_layer": "mixed_float16",
        "/self_attention/attention_output": "mixed_float16",
        "/self_attention/rotary_embedding_layer": "mixed_bfloat16",
        "/self_attention_layernorm": "float32",
        "/self_attention_dropout": "mixed_bfloat16",
        "/feedforward_intermediate_dense": "mixed_float16",
        "/feedforward_gate_dense": "mixed_float16",
        "/feedforward_output_dense": "mixed_bfloat16",
        "/feedforward_layernorm": "float32",
    }
    # The block adds its attention dropout's and its feed-forward output's
    # outputs to its residual stream with `+`: one decision for the three,
    # on the range of the feed-forward output.
    assert layers[block]["reason"].startswith(
        "own ops with tied self_attention_dropout, feedforward_output_dense: "
        "activation max 1.38e+04 > 8188"
    )
    assert layers[f"{block}/feedforward_output_dense"]["reason"] == (
        "tied to llama_backbone/transformer_layer_0 (they meet in an op of one dtype) "
        "-> mixed_bfloat16"
    )
    assert layers[f"{block}/self_attention/query"]["reason"] == (
        "activation max 2.75e+04 > 8188 (float16 max 65504 / headroom 8) -> mixed_bfloat16"
    )
    assert layers[f"{block}/self_attention/attention_softmax"]["errors"]["mixed_float16"] < 1e-2
    # The float8 candidates are the block's projections, each by its own path.
    float8 = result.statistics["float8_layers"]
    assert {path: layer["class"] for path, layer in float8.items()} == {
        f"{block}/self_attention/query": "EinsumDense",
        f"{block}/self_attention/key": "EinsumDense",
        f"{block}/self_attention/value": "EinsumDense",
        f"{block}/self_attention/attention_output": "EinsumDense",
        f"{block}/feedforward_intermediate_dense": "Dense",
        f"{block}/feedforward_gate_dense": "Dense",
        f"{block}/feedforward_output_dense": "Dense",
        "lm_head": "Dense",
    }
    assert float8[f"{block}/feedforward_output_dense"]["reason"] == (
        "mixed_bfloat16, but a float8 layer computes in the default mixed_float16 -> not float8"
    )

    # Applied to a fresh model (its backbone llama_backbone_1), the manifest
    # gives every layer its decision, and the model runs: the tied layers
    # compute in one dtype.
    fresh = _llama_with_head(tiny_llama)
    backbone = next(layer for layer in fresh.layers if isinstance(layer, keras.Model))
    paths = {path: path.replace("llama_backbone", backbone.name, 1) for path in layers}
    report = result.manifest.apply(fresh)
    assert report.unmatched_rules == ()
    assert {path: report.policies[paths[path]] for path in layers} == {
        path: layer["policy"] for path, layer in layers.items()
    }
    assert np.isfinite(keras.ops.convert_to_numpy(fresh(features))).all()
    # Each path calibration decides is one a rule matches, and that rule that layer alone.
    every = PrecisionManifest(
        "mixed_float16", tuple(Rule("float32", path=re.escape(path)) for path in layers)
    ).apply(fresh)
    assert every.unmatched_rules == ()
    assert {path for path, policy in every.policies.items() if policy == "float32"} == set(
        paths.values()
    )


def test_a_wrapped_keras_applications_model_is_measured_layer_by_layer():
    built = []

    def classifier():
        mobilenet = keras.applications.MobileNet(
            input_shape=(32, 32, 3), weights=None, alpha=0.25, classes=10
        )
        inputs = keras.Input((32, 32, 3), name="image")
        built.append(keras.Model(inputs, mobilenet(inputs), name="classifier"))
        return built[-1]

    rng = np.random.default_rng(0)
    images = rng.normal(size=(8, 32, 32, 3)).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy()  # MobileNet ends in a softmax.
    result = calibrate(classifier, (images, rng.integers(0, 10, 8)), loss, steps=1, batch_size=8)

    mobilenet = built[0].get_layer("mobilenet_0.25_32")
    layers = result.statistics["layers"]
    assert list(layers) == [f"{mobilenet.name}/{layer.name}" for layer in mobilenet.layers[1:]]
    assert len(layers) == 90
    assert layers["mobilenet_0.25_32/predictions"]["reason"] == "safe default: model output"
    # The manifest gives every measured layer the policy decided for it.
    report = result.manifest.apply(built[0])
    assert report.unmatched_rules == ()
    assert {path: report.policies[path] for path in layers} == {
        path: layer["policy"] for path, layer in layers.items()
    }


def test_a_rule_for_a_layer_is_kept_from_a_nested_models_layer_with_its_name():
    # Keras' path of the nested model's "big" is "big", as the model's own.
    inputs = keras.Input((4,))
    inner = keras.Model(inputs, Times(1.0, name="big")(inputs), name="inner")
    model = _model(inner, Times(1e5, name="big"))
    result = calibrate(model, _data(), LOSS, steps=1)

    layers = result.statistics["layers"]
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "first": "mixed_float16",
        "inner/big": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }
    assert result.manifest.rules == (
        Rule("mixed_float16", path="functional/inner/big", reason=layers["inner/big"]["reason"]),
        Rule("mixed_bfloat16", path="big", reason=layers["big"]["reason"]),
    )
    assert result.manifest.apply(model).policies == {
        "first": "mixed_float16",
        "inner": "mixed_float16",
        "inner/big": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }


def test_too_large_errors_in_both_low_precisions_give_float32():
    model = _model(keras.layers.Dense(4, name="hidden"))
    thresholds = CalibrationThresholds(max_float16_error=1e-9, max_bfloat16_error=1e-9)
    layers = calibrate(model, _data(), LOSS, steps=1, thresholds=thresholds).statistics["layers"]

    error16 = layers["hidden"]["errors"]["mixed_float16"]
    error_b16 = layers["hidden"]["errors"]["mixed_bfloat16"]
    assert 1e-5 < error16 < error_b16 < 1e-2  # bfloat16 rounds 8x coarser
    assert layers["hidden"]["reason"] == (
        f"float16 error {error16:.2g} > 1e-09; bfloat16 error {error_b16:.2g} > 1e-09 -> float32"
    )


def test_a_block_and_each_of_its_sublayers_are_decided_on_their_own():
    # block multiplies its norm's output by 1e5: its own op, beyond float16's range.
    model = _model(Block(1e5, name="block"))
    result = calibrate(model, _data(), LOSS, steps=1)

    layers = result.statistics["layers"]
    reason = layers["block"]["reason"]
    assert reason.startswith("own ops: activation max ")
    assert reason.endswith("(float16 max 65504 / headroom 8) -> mixed_bfloat16")
    assert layers["block/inner"]["reason"].startswith("range fits float16, error ")
    assert layers["block/norm"]["reason"] == "safe default: normalization"
    assert result.manifest.rules == (Rule("mixed_bfloat16", path="block", reason=reason),)
    assert result.manifest.apply(model).policies == {
        "first": "mixed_float16",
        "block": "mixed_bfloat16",
        "block/inner": "mixed_float16",
        "block/norm": "float32",
        "logits": "float32",
    }


def test_a_sequential_model_not_built_is_built_on_the_first_batch():
    model = keras.Sequential(
        [keras.layers.Dense(4, name="first"), Block(1.0, name="block"), keras.layers.Dense(3)]
    )
    result = calibrate(model, _data(), LOSS, steps=1)

    assert {path: layer["policy"] for path, layer in result.statistics["layers"].items()} == {
        "first": "mixed_float16",
        "block": "mixed_float16",
        "block/inner": "mixed_float16",
        "block/norm": "float32",
        "dense": "float32",
    }


def test_same_data_and_seed_give_identical_statistics():
    model = _model(keras.layers.Dense(4, name="hidden"))
    data = _data()
    first = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=3)
    second = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=3)
    other_seed = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=4)

    assert first.to_json() == second.to_json()
    assert first.manifest == second.manifest
    assert first.statistics["layers"] != other_seed.statistics["layers"]
    json.loads(first.to_json())  # strict JSON: no NaN or Infinity


def test_a_dataset_is_read_for_steps_batches():
    model = _model(keras.layers.Dense(4, name="hidden"))
    features, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
    from_dataset = calibrate(model, dataset, LOSS, steps=2)
    # The same 32 examples as arrays in the same order give the same figures.
    first_32 = calibrate(model, (features[:32], labels[:32]), LOSS, steps=1, batch_size=32)

    assert from_dataset.statistics["steps"] == 2
    assert from_dataset.statistics["layers"]["hidden"]["activations"]["max"] == pytest.approx(
        first_32.statistics["layers"]["hidden"]["activations"]["max"]
    )


def test_policies_and_weights_are_restored():
    model = _model(keras.layers.Dense(4, name="hidden"))
    PrecisionManifest("mixed_bfloat16").apply(model)
    weights = [w.copy() for w in model.get_weights()]
    calibrate(model, _data(), LOSS, steps=1)

    assert {layer.name: layer.dtype_policy.name for layer in model.layers[1:]} == {
        "first": "mixed_bfloat16",
        "hidden": "mixed_bfloat16",
        "logits": "float32",
    }
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps: received 0. Allowed: an integer >= 1"),
        ({"initial_scale": -1.0}, "initial_scale: received -1.0. Allowed: a number > 0"),
        ({"batch_size": 0}, "batch_size: received 0. Allowed: an integer >= 1"),
        ({"float8": 1}, "float8: received 1. Allowed: True or False"),
        ({"data": [1, 2]}, f"data: the batches are int. {DATA_ALLOWED}"),
        (
            {"data": (np.zeros((3, 4)), np.zeros(2))},
            "data: received 3 examples and 2 labels. Allowed: as many labels as examples (in "
            "each output's array), at least one",
        ),
        (
            {"data": (np.zeros((3, 4)), {"a": np.zeros(3), "b": np.zeros((2, 1))})},
            "data: received 3 examples and 2 and 3 labels. Allowed: as many labels as examples "
            "(in each output's array), at least one",
        ),
        (
            {"data": (np.zeros((3, 4)), np.zeros(3), np.ones(2))},
            "data: received 3 examples and 2 sample weights. Allowed: one weight per example",
        ),
        (
            {"data": ({"token_ids": np.zeros((3, 4)), "padding_mask": np.zeros((2, 4))}, [0] * 3)},
            "data: the arrays of x hold 2 and 3 examples. Allowed: as many in each",
        ),
        (
            {"data": tf.data.Dataset.from_tensor_slices({"x": np.zeros((4, 4))}).batch(2)},
            f"data: the dataset yields dict. {DATA_ALLOWED}",
        ),
        (
            {"data": tf.data.Dataset.from_tensor_slices((np.zeros((4, 4)),) * 4).batch(2)},
            f"data: the dataset yields 4-tuples. {DATA_ALLOWED}",
        ),
        (
            {"data": tf.data.Dataset.from_tensor_slices(_data()).batch(2).take(0)},
            f"data: the dataset yielded no batch. {DATA_ALLOWED}",
        ),
        ({"loss": 3}, f"loss: received int. {LOSS_ALLOWED}"),
        ({"loss": "sparse_categorical"}, f"loss: received 'sparse_categorical'. {LOSS_ALLOWED}"),
        ({"loss": {"logits": None}}, f"loss['logits']: received NoneType. {LOSS_ALLOWED}"),
        (
            {"model_or_factory": "model.keras"},
            f"model_or_factory: received str. {MODEL_ALLOWED}",
        ),
        (
            {"model_or_factory": lambda: None},
            f"model_or_factory: the factory returned NoneType. {MODEL_ALLOWED}",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    arguments = {"model_or_factory": _model(), "data": _data(), "loss": LOSS, **kwargs}
    with pytest.raises(UserInputError) as raised:
        calibrate(**arguments)
    assert str(raised.value) == message


class _Subclassed(keras.Model):
    """first, a Residual whose inner layer's outputs (about 1e5) need bfloat16, logits."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.first = keras.layers.Dense(4, name="first")
        self.residual = Residual(1e5, name="residual")
        self.logits = keras.layers.Dense(3, name="logits")

    def call(self, inputs):
        return self.logits(self.residual(self.first(inputs)))


def _subclassed():
    keras.utils.set_random_seed(0)
    model = _Subclassed()
    model(np.zeros((1, 4), "float32"))
    return model


def test_a_subclassed_model_is_decided_by_its_sublayers_tied_ones_together():
    result = calibrate(_subclassed(), _data(), LOSS, steps=1)

    layers = result.statistics["layers"]
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "first": "mixed_float16",
        "residual": "mixed_bfloat16",
        "residual/norm": "float32",
        "residual/inner": "mixed_bfloat16",
        "logits": "float32",
    }
    # inner's range decides for both; inner is not measured alone.
    assert layers["residual"]["reason"].startswith("own ops with tied inner: activation max ")
    assert layers["residual/inner"]["reason"] == (
        "tied to residual (they meet in an op of one dtype) -> mixed_bfloat16"
    )
    assert layers["residual/inner"]["errors"] is None
    # Two layers of three measured got bfloat16: the default.
    assert result.manifest == PrecisionManifest(
        "mixed_bfloat16",
        (Rule("mixed_float16", path="first", reason=layers["first"]["reason"]),),
    )
    features = _data()[0][:2]
    fresh = _subclassed()
    policies = result.manifest.apply(fresh).policies
    assert policies == {path: layer["policy"] for path, layer in layers.items()}
    assert fresh(features).dtype == "float32"
    # Without the tie, the residual's float16 `+` meets inner's bfloat16.
    PrecisionManifest("mixed_float16", (Rule("mixed_bfloat16", path="residual/inner"),)).apply(
        fresh
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="AddV2"):
        fresh(features)


# Float8 --------------------------------------------------------------------------


def _float8_model():
    """`probe` and `clean`, Dense(2) of ones, then `logits`, a frozen Dense(1) of ones.

    With `_output_as_loss` over batches of 4, the gradient at clean's output
    is 1/4 in every entry, at probe's 1/2, at logits' 1/4.
    """
    inputs = keras.Input((2,))
    x = keras.layers.Dense(2, kernel_initializer="ones", name="probe")(inputs)
    x = keras.layers.Dense(2, kernel_initializer="ones", name="clean")(x)
    logits = keras.layers.Dense(
        1, use_bias=False, kernel_initializer="ones", trainable=False, name="logits"
    )(x)
    return keras.Model(inputs, logits)


# Two batches of 4; the second's last example has an input 2 (twice the first
# batch's amax: it saturates at the first batch's scale, 1/448) and one 1e-7
# (4.5e-5 in e4m3 units at any of these scales, below its smallest 2**-9 / 2).
FLOAT8_FEATURES = np.array([[1.0, 1.0]] * 7 + [[2.0, 1e-7]], "float32")
PROBE_REFUSED = (
    "inputs saturate 6.25% in e4m3 > 0.1%; inputs underflow 6.25% in e4m3 > 1% -> not float8"
)
CLEAN_RECOMMENDED = (
    "amax: inputs 2, kernel 1, output gradient 0.25; at most 0% saturate and 0% underflow "
    "in e4m3/e5m2 (<= 0.1%, <= 1%) -> float8"
)
LOGITS_REFUSED = "stays float32 (safe default: model output) -> not float8"


def _float8_calibration(float8, thresholds=CalibrationThresholds()):
    data = tf.data.Dataset.from_tensor_slices((FLOAT8_FEATURES, np.zeros(8))).batch(4)
    return calibrate(
        _float8_model(),
        data,
        _output_as_loss,
        steps=2,
        thresholds=thresholds,
        float8=float8,
        float8_speed="ignore",
    )


def test_float8_figures_quantize_each_batch_at_the_scale_of_the_batches_before():
    result = _float8_calibration(float8=True)

    figures = result.statistics["float8_layers"]
    # Of probe's 16 inputs, the 2 saturates and the 1e-7 underflows; clean's
    # inputs are all 2 (2 + 1e-7 rounds to 2 in float32).
    assert figures["probe"] == {
        "class": "Dense",
        "calls": 2,
        "gemm": [4, 2, 2],
        "inputs": {"format": "e4m3", "amax": 2.0, "saturated": 0.0625, "underflowed": 0.0625},
        "kernel": {"format": "e4m3", "amax": 1.0, "saturated": 0.0, "underflowed": 0.0},
        "outputs_grad": {"format": "e5m2", "amax": 0.5, "saturated": 0.0, "underflowed": 0.0},
        "policy": "mixed_float16",
        "recommended": False,
        "reason": PROBE_REFUSED,
    }
    assert figures["clean"]["inputs"]["amax"] == 2.0
    assert figures["clean"]["outputs_grad"]["amax"] == 0.25
    assert {path: (layer["policy"], layer["reason"]) for path, layer in figures.items()} == {
        "probe": ("mixed_float16", PROBE_REFUSED),
        "clean": ("float8", CLEAN_RECOMMENDED),
        "logits": ("float32", LOGITS_REFUSED),
    }
    assert result.statistics["float8"] is True
    assert result.manifest == PrecisionManifest(
        "mixed_float16", (Rule("float8", path="clean", reason=CLEAN_RECOMMENDED),)
    )


def test_float8_is_off_by_default_and_its_figures_are_recorded_all_the_same():
    result = _float8_calibration(float8=False)

    figures = result.statistics["float8_layers"]
    assert (figures["clean"]["recommended"], figures["clean"]["policy"]) == (True, "mixed_float16")
    assert figures["clean"]["reason"] == CLEAN_RECOMMENDED
    assert result.statistics["float8"] is False
    assert result.manifest == PrecisionManifest("mixed_float16")
    table = format_calibration_table(result.statistics)
    assert "in_amax" not in table  # The float8 table comes with float8 rules only.


def test_float8_thresholds_decide_and_the_manifest_loads_and_applies(tmp_path):
    lenient = CalibrationThresholds(
        max_float8_saturated_fraction=0.1, max_float8_underflowed_fraction=0.1
    )
    result = _float8_calibration(float8=True, thresholds=lenient)

    probe = result.statistics["float8_layers"]["probe"]
    assert probe["reason"] == (
        "amax: inputs 2, kernel 1, output gradient 0.5; at most 6.25% saturate and 6.25% "
        "underflow in e4m3/e5m2 (<= 10%, <= 10%) -> float8"
    )
    assert [rule.path for rule in result.manifest.rules] == ["probe", "clean"]
    path = tmp_path / "float8.json"
    path.write_text(result.manifest.to_json())
    model = _float8_model()
    report = PrecisionManifest.from_json(path).apply(model)
    assert report.policies == {
        "probe": "float8_from_mixed_float16",
        "clean": "float8_from_mixed_float16",
        "logits": "float32",
    }
    table = format_calibration_table(result.statistics).splitlines()
    float8_table = table[table.index("") + 1 :]
    assert float8_table[0].split() == [
        "path", "class", "in_amax", "in_sat", "in_under", "k_amax", "k_under",
        "g_amax", "g_sat", "g_under", "policy", "reason",
    ]  # fmt: skip
    assert float8_table[1].split()[:11] == [
        "probe", "Dense", "2", "6.25%", "6.25%", "1", "0%", "0.5", "0%", "0%", "float8",
    ]  # fmt: skip
    assert [line.split()[0] for line in float8_table[1:]] == ["probe", "clean", "logits"]


@pytest.mark.parametrize(
    "steps, kernel, reason",
    [
        # The first batch, at its own scale: nothing saturates.
        (
            1,
            [[1.0, 1.0], [1.0, 1.0]],
            "amax: inputs 1, kernel 1, output gradient 0.25; at most 0% saturate and 0% "
            "underflow in e4m3/e5m2 (<= 0.1%, <= 1%) -> float8",
        ),
        # The second batch's last example weighs 2: its gradients, twice the
        # first batch's amax, saturate (2 of 16).
        (
            2,
            [[1.0, 1.0], [1.0, 1.0]],
            "output gradient saturates 12.5% in e5m2 > 0.1% -> not float8",
        ),
        # 1e-7 next to 1 in the kernel: below e4m3's range at the kernel's scale.
        (
            1,
            [[1.0, 1.0], [1e-7, 1e-7]],
            "kernel underflows 50% in e4m3 > 1% -> not float8",
        ),
    ],
    ids=["first_batch", "larger_gradient_saturates", "small_weights_underflow"],
)
def test_float8_reasons_name_the_share_beyond_its_threshold(steps, kernel, reason):
    model = _probe_model(downstream=1.0)
    model.get_layer("probe").kernel.assign(np.array(kernel, "float32"))
    weights = np.array([1.0] * 7 + [2.0], "float32")
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 2), "float32"), np.zeros(8), weights))
    result = calibrate(
        model, data.batch(4), _output_as_loss, steps=steps, float8=True, float8_speed="ignore"
    )

    assert result.statistics["float8_layers"]["probe"]["reason"] == reason


def test_float8_follows_each_layers_own_decision():
    # wide's kernel, of weights about 1e4, puts its outputs beyond float16's range: bfloat16.
    kernel = keras.initializers.RandomNormal(stddev=1e4, seed=0)
    wide = keras.layers.Dense(4, kernel_initializer=kernel, name="wide")
    model = _model(Block(1.0, name="block"), wide)
    result = calibrate(model, _data(), LOSS, steps=1, float8=True, float8_speed="ignore")

    figures = result.statistics["float8_layers"]
    assert {path: layer["policy"] for path, layer in figures.items()} == {
        "first": "float8",
        "block/inner": "float8",
        "wide": "mixed_bfloat16",
        "logits": "float32",
    }
    assert figures["block/inner"]["reason"].endswith("-> float8")
    assert figures["wide"]["reason"] == (
        "mixed_bfloat16, but a float8 layer computes in the default mixed_float16 -> not float8"
    )
    wide_reason = result.statistics["layers"]["wide"]["reason"]
    assert result.manifest.rules == (
        Rule("float8", path="first", reason=figures["first"]["reason"]),
        Rule("float8", path="block/inner", reason=figures["block/inner"]["reason"]),
        Rule("mixed_bfloat16", path="wide", reason=wide_reason),
    )
    assert result.manifest.apply(model).policies == {
        "first": "float8_from_mixed_float16",
        "block": "mixed_float16",
        "block/inner": "float8_from_mixed_float16",
        "block/norm": "float32",
        "wide": "mixed_bfloat16",
        "logits": "float32",
    }

    # Kept float32 for their numbers, the layers get no float8.
    strict = CalibrationThresholds(max_float16_error=1e-9, max_bfloat16_error=1e-9)
    model = _model(Block(1.0, name="block"))
    figures = calibrate(model, _data(), LOSS, steps=1, thresholds=strict).statistics[
        "float8_layers"
    ]
    assert figures["first"]["reason"] == "stays float32 (for its numbers) -> not float8"
    # Decided on its own, not as a part of block.
    assert figures["block/inner"]["reason"] == "stays float32 (for its numbers) -> not float8"


def test_a_float8_rule_matches_its_layer_alone():
    # Keras' path of the nested model's "hidden" is "hidden", as the model's own.
    inputs = keras.Input((4,))
    inner = keras.Model(inputs, keras.layers.Dense(4, name="hidden")(inputs), name="inner")
    model = _model(inner, keras.layers.Dense(4, name="hidden"))
    result = calibrate(model, _data(), LOSS, steps=1, float8=True, float8_speed="ignore")

    assert [rule.path for rule in result.manifest.rules] == [
        "first",
        "inner/hidden",
        "functional/hidden",
    ]
    policies = result.manifest.apply(model).policies
    assert (policies["inner/hidden"], policies["hidden"]) == ("float8_from_mixed_float16",) * 2


def test_exact_path_rules_escape_the_path():
    # Unescaped, the rule for "big.0" would also match "bigx0".
    model = _model(Times(1.0, name="bigx0"), Times(1e5, name="big.0"))
    result = calibrate(model, _data(), LOSS, steps=1)

    reason = result.statistics["layers"]["big.0"]["reason"]
    assert result.manifest.rules == (Rule("mixed_bfloat16", path=r"big\.0", reason=reason),)
    policies = result.manifest.apply(model).policies
    assert (policies["big.0"], policies["bigx0"]) == ("mixed_bfloat16", "mixed_float16")


class Root(keras.layers.Layer):
    """The square root: at 0 its gradient is infinite."""

    def call(self, inputs):
        return keras.ops.sqrt(inputs)


class Holder(keras.layers.Layer):
    """Passes its inputs through; holds a built Dense it never calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.spare = keras.layers.Dense(2, name="spare", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.spare.build(input_shape)

    def call(self, inputs):
        return inputs


def test_float8_refuses_a_layer_it_cannot_measure():
    # probe's kernel of zeros gives zeros, whose square root has an infinite gradient.
    model = _model(
        keras.layers.Dense(4, kernel_initializer="zeros", name="probe"),
        Root(name="root"),
        Holder(name="holder"),
    )
    result = calibrate(model, _data(), LOSS, steps=1, float8=True, float8_speed="ignore")

    figures = result.statistics["float8_layers"]
    assert figures["probe"]["kernel"] == {
        "format": "e4m3",
        "amax": 0.0,
        "saturated": 0.0,
        "underflowed": 0.0,
    }
    assert figures["probe"]["outputs_grad"] == {
        "format": "e5m2",
        "amax": "inf",
        "saturated": "nan",
        "underflowed": "nan",
    }
    assert figures["probe"]["reason"] == "output gradient not finite in float32 -> not float8"
    assert figures["holder/spare"]["calls"] == 0
    assert figures["holder/spare"]["reason"] == (
        "not called on the calibration batches -> not float8"
    )
    assert result.statistics["diagnosis"].startswith("statistics batch 1 of 1")


def test_a_model_in_float8_is_measured_in_float32_and_left_in_float8():
    model = _float8_model()
    PrecisionManifest("mixed_float16", (Rule("float8", path="clean"),)).apply(model)
    data = tf.data.Dataset.from_tensor_slices((FLOAT8_FEATURES, np.zeros(8))).batch(4)
    result = calibrate(model, data, _output_as_loss, steps=2, float8=True, float8_speed="ignore")

    # Its float8 state (clean/inputs_scale, ...) has no gradient to measure.
    assert set(result.statistics["gradients"]) == {
        "probe/kernel",
        "probe/bias",
        "clean/kernel",
        "clean/bias",
    }
    assert (
        result.statistics["float8_layers"] == _float8_calibration(True).statistics["float8_layers"]
    )
    assert model.get_layer("clean").dtype_policy.name == "float8_from_mixed_float16"


def test_a_post_norm_blocks_float32_norm_is_tied_to_nothing_and_the_block_stays_low():
    # The manifest hands the norm's output back in the block's dtype (precision/hand_back.py):
    # the block need not compute in float32 with it, as it did when the two were tied.
    model = _model(PostNormBlock(name="block"))
    features, labels = _data()
    result = calibrate(model, (features, labels), LOSS, steps=1, batch_size=32)

    layers = result.statistics["layers"]
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "first": "mixed_float16",
        "block": "mixed_float16",
        "block/norm": "float32",
        "block/inner": "mixed_float16",
        "logits": "float32",
    }
    assert layers["block"]["reason"].startswith("own ops with tied inner: range fits float16")
    assert layers["block/norm"]["reason"] == "safe default: normalization"
    # Left as found: its manifests' applies hand the norm back only while it runs.
    assert hand_back_of(model.get_layer("block").norm) is None
    report = result.manifest.apply(model)
    assert report.policies["block"] == "mixed_float16"
    assert {layer.path: layer.returns_dtype for layer in report.layers}["block/norm"] == "float16"
    assert keras.backend.standardize_dtype(model(features).dtype) == "float32"

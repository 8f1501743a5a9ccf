"""Tests of mpt_keras.precision.manifest: parsing, precedence, safe defaults, apply, saving."""

import dataclasses
import functools
import json
import os

import keras
import numpy as np
import pytest

from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.names import COMPUTE_DTYPES
from mpt_keras.precision.report import precision_report
from mpt_keras.precision.rules import Rule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = "Allowed: float32, mixed_float16, mixed_bfloat16"
RULE_ALLOWED = "Allowed: float32, mixed_float16, mixed_bfloat16, float8"

# Default mixed_float16, the attention projections of block 0 in bfloat16, the
# norms and the logits kept float32 by the safe defaults.
LM_MANIFEST = {
    "version": 1,
    "default": "mixed_float16",
    "rules": [{"match": {"path": "block_0/attention/.*"}, "policy": "mixed_bfloat16"}],
}
ATTENTION_RULE = "rules[0] (path 'block_0/attention/.*')"
NORMALIZATION = "safe default: normalization"
# {path: (class, policy, decided_by)} of the tiny LM under LM_MANIFEST.
LM_EXPECTED = {
    "token_embedding": ("Embedding", "mixed_float16", "default"),
    "position_embedding": ("PositionEmbedding", "mixed_float16", "default"),
    "block_0": ("DecoderBlock", "mixed_float16", "default"),
    "block_0/attention_norm": ("LayerNormalization", "float32", NORMALIZATION),
    "block_0/attention": ("MultiHeadAttention", "mixed_float16", "default"),
    "block_0/attention/query": ("EinsumDense", "mixed_bfloat16", ATTENTION_RULE),
    "block_0/attention/key": ("EinsumDense", "mixed_bfloat16", ATTENTION_RULE),
    "block_0/attention/value": ("EinsumDense", "mixed_bfloat16", ATTENTION_RULE),
    # Made by the attention for itself, without a Keras path: named by attribute.
    "block_0/attention/_softmax": ("Softmax", "mixed_bfloat16", ATTENTION_RULE),
    "block_0/attention/_dropout_layer": ("Dropout", "mixed_bfloat16", ATTENTION_RULE),
    "block_0/attention/attention_output": ("EinsumDense", "mixed_bfloat16", ATTENTION_RULE),
    "block_0/mlp_norm": ("LayerNormalization", "float32", NORMALIZATION),
    "block_0/mlp_up": ("Dense", "mixed_float16", "default"),
    "block_0/mlp_down": ("Dense", "mixed_float16", "default"),
    "block_0/mlp_dropout": ("Dropout", "mixed_float16", "default"),
    "final_norm": ("LayerNormalization", "float32", NORMALIZATION),
    "logits": ("Dense", "float32", "safe default: model output"),
}


@pytest.fixture(autouse=True)
def _restore_keras():
    keras.backend.clear_session(free_memory=False)
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)


def _tiny_lm():
    return models.build_model(
        "transformer_lm",
        {"num_layers": 1, "d_model": 16, "num_heads": 2},
        vocab_size=32,
        sequence_length=8,
    )


def _tokens(batch=4):
    return np.random.default_rng(0).integers(0, 32, size=(batch, 8)).astype("int32")


def _policies(model):
    return precision_report(model).policies


def _output_dtypes(model, inputs, monkeypatch):
    """Runs `model` once; returns {path: dtype of the output} of every layer called."""
    dtypes = {}
    for path, layer in iter_layers(model):

        def recording_call(*args, _path=path, _call=layer.call, **kwargs):
            outputs = _call(*args, **kwargs)
            dtypes[_path] = keras.tree.flatten(outputs)[0].dtype.name
            return outputs

        monkeypatch.setattr(layer, "call", recording_call)
    model(inputs)
    return dtypes


# Apply to a built functional model ------------------------------------------


def test_apply_sets_exact_compute_and_variable_dtypes_of_nested_layers():
    model = _tiny_lm()
    report = PrecisionManifest.from_dict(LM_MANIFEST).apply(model)

    assert [
        (layer.path, layer.layer_class, layer.policy, layer.decided_by) for layer in report.layers
    ] == [(path, *expected) for path, expected in LM_EXPECTED.items()]
    layers = dict(iter_layers(model))
    for path, (_, policy, _) in LM_EXPECTED.items():
        assert layers[path].compute_dtype == COMPUTE_DTYPES[policy], path
        assert layers[path].variable_dtype == "float32", path
    assert {variable.dtype for variable in model.weights} == {"float32"}
    assert report.policies == {path: policy for path, (_, policy, _) in LM_EXPECTED.items()}
    assert report.unmatched_rules == report.shadowed_rules == ()


def test_layers_built_under_float32_compute_in_their_new_dtypes(monkeypatch):
    model = _tiny_lm()
    report = PrecisionManifest.from_dict(LM_MANIFEST).apply(model)

    expected = {
        "token_embedding": "float16",
        "position_embedding": "float16",
        "block_0": "float16",
        # Computes in float32, hands back block_0's float16 (its `+` is one dtype's).
        "block_0/attention_norm": "float16",
        "block_0/attention": "bfloat16",  # the output projection's dtype
        "block_0/attention/query": "bfloat16",
        "block_0/attention/key": "bfloat16",
        "block_0/attention/value": "bfloat16",
        "block_0/attention/attention_output": "bfloat16",
        "block_0/mlp_norm": "float16",
        "block_0/mlp_up": "float16",
        "block_0/mlp_down": "float16",
        "block_0/mlp_dropout": "float16",
        "final_norm": "float32",  # In the model's graph: the next layer casts its inputs.
        "logits": "float32",
    }
    assert _output_dtypes(model, _tokens(), monkeypatch) == expected
    # The report's traced forward pass sees what the eager call does; the fused
    # attention calls neither its softmax nor its dropout layer.
    assert {layer.path: layer.output_dtype for layer in report.layers} == {
        **expected,
        "block_0/attention/_softmax": None,
        "block_0/attention/_dropout_layer": None,
    }
    # The attention (mixed_float16) returns its output projection's bfloat16,
    # which that projection computes in: no layer made another dtype.
    assert report.output_dtype_mismatches == ()
    assert {layer.path: layer.returns_dtype for layer in report.layers if layer.returns_dtype} == {
        "block_0/attention_norm": "float16",
        "block_0/mlp_norm": "float16",
    }


def test_the_report_extends_precision_report_with_the_decisions():
    model = _tiny_lm()
    applied = PrecisionManifest.from_dict(LM_MANIFEST).apply(model)
    described = precision_report(model)

    assert applied == dataclasses.replace(
        described,
        layers=tuple(
            dataclasses.replace(base, decided_by=entry.decided_by, reason=entry.reason)
            for entry, base in zip(applied.layers, described.layers, strict=True)
        ),
    )
    assert (applied.model, applied.trainable_variables) == ("transformer_lm", {"float32": 22})
    report = applied.to_dict()
    assert report["layers"][3] == {
        "path": "block_0/attention_norm",
        "class": "LayerNormalization",
        "policy": "float32",
        "compute_dtype": "float32",
        "variable_dtype": "float32",
        "output_dtype": "float16",
        "decided_by": "safe default: normalization",
        "reason": "mean and variance round badly in float16/bfloat16",
        "returns_dtype": "float16",
    }
    assert report["layers"][-1]["output_dtype"] == "float32"  # logits, the model output
    assert report["output_dtype_mismatches"] == report["unmatched_rules"] == []
    assert report["shadowed_rules"] == []
    assert json.loads(json.dumps(report)) == report


# Sequential and subclassed models, before and after building ------------------

# {path: policy} of the models of _sequential() and _subclassed() under LM_MANIFEST
# with "block_0" named "block".
SMALL_EXPECTED = {
    "up": "mixed_float16",
    "block": "mixed_float16",
    "block/attention_norm": "float32",
    "block/attention": "mixed_float16",
    "block/attention/query": "mixed_bfloat16",
    "block/attention/key": "mixed_bfloat16",
    "block/attention/value": "mixed_bfloat16",
    "block/attention/_softmax": "mixed_bfloat16",
    "block/attention/_dropout_layer": "mixed_bfloat16",
    "block/attention/attention_output": "mixed_bfloat16",
    "block/mlp_norm": "float32",
    "block/mlp_up": "mixed_float16",
    "block/mlp_down": "mixed_float16",
    "block/mlp_dropout": "mixed_float16",
    "out": "float32",
}
SMALL_MANIFEST = {
    "version": 1,
    "default": "mixed_float16",
    "rules": [{"match": {"path": "block/attention/.*"}, "policy": "mixed_bfloat16"}],
}


def _sequential():
    return keras.Sequential(
        [
            keras.layers.Dense(8, name="up"),
            models.DecoderBlock(8, 2, name="block"),
            keras.layers.Dense(3, name="out"),
        ],
        name="sequential",
    )


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(8, name="up")
        self.block = models.DecoderBlock(8, 2, name="block")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, inputs):
        return self.out(self.block(self.up(inputs)))


@pytest.mark.parametrize(
    # Named: Keras would name it "__subclassed", which no tf.function (fit's
    # step, the report's trace) takes as a name scope.
    "build_model",
    [_sequential, functools.partial(_Subclassed, name="subclassed")],
    ids=["sequential", "subclassed"],
)
@pytest.mark.parametrize("built", [False, True], ids=["before_build", "after_build"])
def test_apply_to_sequential_and_subclassed_models(build_model, built, monkeypatch):
    model = build_model()
    inputs = np.ones((2, 5, 4), "float32")
    if built:
        model(inputs)
    report = PrecisionManifest.from_dict(SMALL_MANIFEST).apply(model, inputs=inputs)
    if not built:
        model(inputs)

    assert _policies(model) == SMALL_EXPECTED
    layers = dict(iter_layers(model))
    for path, policy in SMALL_EXPECTED.items():
        assert layers[path].compute_dtype == COMPUTE_DTYPES[policy], path
    assert {variable.dtype for variable in model.weights} == {"float32"}
    assert _output_dtypes(model, inputs, monkeypatch)["block/attention/query"] == "bfloat16"
    output_dtypes = {layer.path: layer.output_dtype for layer in report.layers}
    assert report.output_dtype_mismatches == ()
    if built:
        assert report.policies == SMALL_EXPECTED
        assert report.unmatched_rules == ()
        assert output_dtypes["block/attention/query"] == "bfloat16"
        assert output_dtypes["out"] == "float32"
    else:
        assert set(output_dtypes.values()) == {None}  # Not traced: that would build it.
        # The attention projections did not exist yet: decided when built.
        assert "block/attention/query" not in report.policies
        assert report.unmatched_rules == ("rules[0] (path 'block/attention/.*')",)
        assert PrecisionManifest.from_dict(SMALL_MANIFEST).apply(model).unmatched_rules == ()


def test_a_later_apply_replaces_an_earlier_one_also_before_build():
    model = _sequential()
    PrecisionManifest.from_dict(SMALL_MANIFEST).apply(model)
    PrecisionManifest(
        default="mixed_bfloat16",
        rules=(Rule(policy="float32", path="block/attention/query"),),
        safe_defaults=False,
    ).apply(model)
    model(np.ones((2, 5, 4), "float32"))

    policies = _policies(model)
    assert policies.pop("block/attention/query") == "float32"
    assert set(policies.values()) == {"mixed_bfloat16"}


# Precedence, unmatched and shadowed rules -----------------------------------------


def test_first_matching_rule_in_file_order_wins():
    manifest = PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_bfloat16",
            "rules": [
                {"match": {"path": "block_0/.*"}, "policy": "mixed_float16"},
                {"match": {"class": "LayerNormalization"}, "policy": "mixed_bfloat16"},
                {"match": {"path": "block_0/attention_norm"}, "policy": "float32"},
                {"match": {"path": "block_0"}, "policy": "float32"},
                {"match": {"path": "block_9/.*"}, "policy": "float32"},
            ],
        }
    )
    report = manifest.apply(_tiny_lm())
    decided = {layer.path: (layer.policy, layer.decided_by) for layer in report.layers}

    assert decided["block_0/attention_norm"] == ("mixed_float16", "rules[0] (path 'block_0/.*')")
    assert decided["block_0/attention/query"] == ("mixed_float16", "rules[0] (path 'block_0/.*')")
    assert decided["block_0"] == ("float32", "rules[3] (path 'block_0')")  # no prefix match
    assert decided["final_norm"] == (
        "mixed_bfloat16",
        "rules[1] (class 'LayerNormalization')",  # a rule beats a safe default
    )
    assert decided["logits"] == ("float32", "safe default: model output")
    assert decided["token_embedding"] == ("mixed_bfloat16", "default")
    assert report.shadowed_rules == ("rules[2] (path 'block_0/attention_norm')",)
    assert report.unmatched_rules == ("rules[4] (path 'block_9/.*')",)


def test_rule_with_path_and_class_needs_both_and_class_matches_subclasses():
    class ScaledDense(keras.layers.Dense):
        pass

    rule = Rule(policy="float32", path="head_.*", layer_class="Dense")
    assert rule.matches("head_0", ScaledDense(2))
    assert not rule.matches("head_0", keras.layers.Conv1D(2, 1))
    assert not rule.matches("tail_0", keras.layers.Dense(2))
    assert Rule(policy="float32", path="out.1").matches("out.1", keras.layers.Dense(2))
    assert rule.match_text == "path 'head_.*', class 'Dense'"
    # Given every form of a layer's path, any one may match.
    assert rule.matches(("model/head_0", "head_0"), ScaledDense(2))
    assert not rule.matches(("model/head_0", "model/tail_0"), ScaledDense(2))


# Safe defaults ---------------------------------------------------------------


class RMSNorm(keras.layers.Layer):
    """A user normalization layer, matched by its class name."""

    def call(self, inputs):
        return inputs * keras.ops.rsqrt(keras.ops.mean(inputs**2, axis=-1, keepdims=True) + 1e-6)


def _model_with_every_safe_default():
    inputs = keras.Input((4, 4, 2), name="image")
    x = keras.layers.BatchNormalization(name="batch_norm")(inputs)
    x = keras.layers.GroupNormalization(groups=2, name="group_norm")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.UnitNormalization(name="unit_norm")(x)
    x = keras.layers.RMSNormalization(name="rms_norm")(x)
    x = RMSNorm(name="user_norm")(x)
    hidden = keras.layers.Dense(3, name="dense")(x)
    probabilities = keras.layers.Softmax(name="probabilities")(hidden)
    head_inputs = keras.Input((3,))
    head = keras.Model(
        head_inputs, keras.layers.Dense(2, name="head_dense")(head_inputs), name="head"
    )
    return keras.Model(inputs, [probabilities, head(hidden)], name="classifier")


def test_safe_defaults_keep_normalization_and_output_layers_float32():
    report = PrecisionManifest(default="mixed_bfloat16").apply(_model_with_every_safe_default())

    output = "safe default: model output"
    assert {layer.path: (layer.policy, layer.decided_by) for layer in report.layers} == {
        "batch_norm": ("float32", NORMALIZATION),
        "group_norm": ("float32", NORMALIZATION),
        "flatten": ("mixed_bfloat16", "default"),
        "unit_norm": ("float32", NORMALIZATION),
        "rms_norm": ("float32", NORMALIZATION),
        "user_norm": ("float32", NORMALIZATION),
        "dense": ("mixed_bfloat16", "default"),
        "probabilities": ("float32", output),
        "head": ("mixed_bfloat16", "default"),
        "head/head_dense": ("float32", output),  # the output of the nested model
    }


def test_safe_defaults_can_be_turned_off_or_overridden_by_a_rule():
    off = PrecisionManifest(default="mixed_bfloat16", safe_defaults=False).apply(_tiny_lm())
    assert set(off.policies.values()) == {"mixed_bfloat16"}

    overridden = PrecisionManifest(
        default="mixed_bfloat16",
        rules=(Rule(policy="mixed_float16", layer_class="LayerNormalization"),),
    ).apply(_tiny_lm())
    assert overridden.policies["final_norm"] == "mixed_float16"
    assert overridden.policies["logits"] == "float32"


def test_subclassed_model_output_is_its_last_layer_with_weights():
    class Classifier(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4, name="hidden")
            self.logits = keras.layers.Dense(2, name="logits")
            self.dropout = keras.layers.Dropout(0.1, name="dropout")

        def call(self, inputs):
            return self.logits(self.dropout(self.hidden(inputs)))

    policies = PrecisionManifest(default="mixed_float16").apply(Classifier()).policies
    assert policies == {"hidden": "mixed_float16", "logits": "float32", "dropout": "mixed_float16"}


class _TwoHeads(keras.Model):
    """Returns `{"digit", "parity"}`: its last own layer is one head of two."""

    def __init__(self, after_parity: str):
        super().__init__(name="two_heads")
        self.after_parity = after_parity
        self.hidden = keras.layers.Dense(4, name="hidden")
        self.digit = keras.layers.Dense(3, name="digit")
        self.parity = keras.layers.Dense(1, name="parity")
        self.dropout = keras.layers.Dropout(0.5, name="dropout")
        self.fail = False

    def call(self, inputs):
        if self.fail:
            raise RuntimeError("not on this batch")
        features = self.hidden(inputs)
        parity = self.parity(features)
        if self.after_parity == "squeeze":  # An operation's output: its maker is not found.
            parity = keras.ops.squeeze(parity, -1)
        elif self.after_parity == "dropout":  # The identity at inference: parity's tensor.
            parity = self.dropout(parity)
        return {"digit": self.digit(features), "parity": parity}


@pytest.mark.parametrize(
    "after_parity, inputs, fail, digit",
    [
        ("nothing", np.ones((2, 4), "float32"), False, "float32"),  # Its call shows both.
        ("dropout", np.ones((2, 4), "float32"), False, "float32"),
        # Not found by the call: its last layer (with weights) stands for the outputs.
        ("squeeze", np.ones((2, 4), "float32"), False, "float32"),
        ("nothing", None, False, "mixed_float16"),  # Nothing to call it on.
        ("nothing", keras.KerasTensor((2, 4)), False, "mixed_float16"),  # A spec runs no call.
        ("nothing", np.ones((2, 4), "float32"), True, "mixed_float16"),  # The call fails.
    ],
    ids=["called", "a_dropout_after_a_head", "an_operation_after_a_head", "no_inputs", "a_spec",
         "a_call_that_fails"],
)  # fmt: skip
def test_a_subclassed_models_outputs_are_the_layers_its_call_returns_from(
    after_parity, inputs, fail, digit, caplog
):
    model = _TwoHeads(after_parity)
    model(np.ones((2, 4), "float32"))
    model.fail = fail
    report = PrecisionManifest(default="mixed_float16").apply(model, inputs=inputs)
    assert {path: report.policies[path] for path in ("hidden", "digit", "parity")} == {
        "hidden": "mixed_float16",
        "digit": digit,
        "parity": "float32",
    }
    assert report.policies["dropout"] == "mixed_float16"
    warned = [
        record.getMessage() for record in caplog.records if "not called" in record.getMessage()
    ]
    assert len(warned) == fail
    if fail:  # In one line: Keras' lines joined, without the call's arguments it lists.
        raised_at = _line_of('raise RuntimeError("not on this batch")')
        assert warned[0] == (
            "Model two_heads: not called to find the layers making its outputs (RuntimeError: "
            "Exception encountered when calling _TwoHeads.call(). not on this batch "
            f"({__file__}, line {raised_at}))"
        )


def _line_of(text: str) -> int:
    """The line of this file holding `text`."""
    with open(__file__, encoding="utf-8") as source:
        return next(number for number, line in enumerate(source, 1) if text in line)


# Real models: layers Keras gives no path, path forms, instances --------------------


def _gpt2_inputs():
    tokens = np.random.default_rng(0).integers(0, 64, size=(2, 8)).astype("int32")
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


def _keras_attention():
    """Keras' own MultiHeadAttention; with dropout it calls its _softmax."""
    inputs = keras.Input((8, 16))
    attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="self_attention")
    outputs = keras.layers.Dense(4, name="logits")(attention(inputs, inputs))
    return keras.Model(inputs, outputs, name="attention_model")


@pytest.mark.parametrize(
    "build_model, inputs, softmax_paths",
    [
        (
            "tiny_gpt2",
            _gpt2_inputs,
            [
                "transformer_layer_0/self_attention/_softmax",
                "transformer_layer_1/self_attention/_softmax",
            ],
        ),
        (
            "keras_attention",
            lambda: np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32"),
            ["self_attention/_softmax"],
        ),
    ],
    ids=["keras_hub_gpt2", "keras_attention"],
)
@pytest.mark.parametrize(
    "match", [{"class": "Softmax"}, {"path": ".*/_softmax"}], ids=["by_class", "by_path"]
)
def test_a_rule_keeps_every_attention_softmax_float32_inside_float16_layers(
    build_model, inputs, softmax_paths, match, monkeypatch, tiny_gpt2
):
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny_gpt2() if build_model == "tiny_gpt2" else _keras_attention()
    keras.config.set_dtype_policy("float32")
    manifest = PrecisionManifest.from_dict(
        {"version": 1, "default": "mixed_float16", "rules": [{"match": match, "policy": "float32"}]}
    )
    report = manifest.apply(model)

    layers = dict(iter_layers(model))
    assert [path for path, layer in layers.items() if type(layer).__name__ == "Softmax"] == (
        softmax_paths
    )
    rule = f"rules[0] ({manifest.rules[0].match_text})"
    assert {
        entry.path: (entry.policy, entry.decided_by)
        for entry in report.layers
        if entry.decided_by.startswith("rules")
    } == {path: ("float32", rule) for path in softmax_paths}
    # What Keras 3.15.1's MultiHeadAttention gives its softmax (the scores,
    # computed in float16) and what the softmax returns.
    seen = {}
    for path in softmax_paths:
        attention_path = path.removesuffix("/_softmax")
        attention = layers[attention_path]
        assert attention.compute_dtype == layers[f"{attention_path}/query"].compute_dtype
        assert (attention.compute_dtype, layers[path].compute_dtype) == ("float16", "float32")

        def masked_softmax(scores, mask=None, _path=path, _call=attention._masked_softmax):
            probabilities = _call(scores, mask)
            seen[_path] = (scores.dtype.name, probabilities.dtype.name)
            return probabilities

        monkeypatch.setattr(attention, "_masked_softmax", masked_softmax)
    model(inputs())
    assert seen == {path: ("float16", "float32") for path in softmax_paths}


def test_one_manifest_gives_every_instance_bare_or_wrapped_the_same_policies(tiny_gpt2):
    manifest = PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_float16",
            "rules": [
                # The first instance's name in front, as Keras paths the layers
                # of a Sequential or subclassed model built by calling it.
                {
                    "match": {"path": "gpt2_backbone/transformer_layer_1/feedforward_.*_dense"},
                    "policy": "mixed_bfloat16",
                },
                # Keras' own layer.path, also of a wrapped backbone's layers.
                {
                    "match": {"path": "transformer_layer_0/self_attention/(query|key)"},
                    "policy": "float32",
                },
                {"match": {"path": ".*/_softmax"}, "policy": "float32"},
            ],
        }
    )
    first, second, third = tiny_gpt2(), tiny_gpt2(), tiny_gpt2()
    wrapper = keras.Model(third.input, third(third.input))
    assert [model.name for model in (first, second, third)] == [
        "gpt2_backbone",
        "gpt2_backbone_1",
        "gpt2_backbone_2",
    ]

    reports = [manifest.apply(model) for model in (first, second, wrapper)]

    bare = reports[0].policies
    assert {path: policy for path, policy in bare.items() if policy != "mixed_float16"} == {
        "transformer_layer_0/self_attention/query": "float32",
        "transformer_layer_0/self_attention/key": "float32",
        "transformer_layer_0/self_attention/_softmax": "float32",
        "transformer_layer_0/self_attention_layer_norm": "float32",
        "transformer_layer_0/feedforward_layer_norm": "float32",
        "transformer_layer_1/self_attention/_softmax": "float32",
        "transformer_layer_1/self_attention_layer_norm": "float32",
        "transformer_layer_1/feedforward_intermediate_dense": "mixed_bfloat16",
        "transformer_layer_1/feedforward_output_dense": "mixed_bfloat16",
        "transformer_layer_1/feedforward_layer_norm": "float32",
        "layer_norm": "float32",
    }
    assert reports[1].policies == bare
    wrapped = reports[2].policies
    assert wrapped.pop("gpt2_backbone_2") == "mixed_float16"
    assert {path.removeprefix("gpt2_backbone_2/"): policy for path, policy in wrapped.items()} == (
        bare
    )
    assert all(report.unmatched_rules == () for report in reports)


def test_rules_match_the_keras_paths_of_a_sequential_called_once():
    keras.Sequential([keras.layers.Dense(2)])  # Takes the name "sequential".
    model = keras.Sequential([keras.layers.Dense(4, name="up"), keras.layers.Dense(2, name="out")])
    model(np.ones((1, 3), "float32"))
    assert (model.name, model.get_layer("up").path) == ("sequential_1", "sequential_1/up")

    for path in ("up", "sequential_1/up", "sequential/up"):
        report = PrecisionManifest("mixed_float16", (Rule("mixed_bfloat16", path=path),)).apply(
            model
        )
        assert report.policies == {"up": "mixed_bfloat16", "out": "float32"}, path
    named = keras.Sequential([keras.layers.Dense(4, name="up")], name="mlp_1")
    # A name given on purpose is not Keras' numbering: "mlp" is another model.
    report = PrecisionManifest("mixed_float16", (Rule("float32", path="mlp/up"),)).apply(named)
    assert report.unmatched_rules == ("rules[0] (path 'mlp/up')",)


def test_a_layer_at_two_paths_is_tried_in_the_forms_of_both(tiny_gpt2):
    # As keras_hub's GPT2CausalLM: the backbone's token embedding also gives the logits.
    backbone = tiny_gpt2()
    model = keras.Model(
        backbone.input, backbone.token_embedding(backbone(backbone.input), reverse=True)
    )
    rule = Rule("mixed_bfloat16", path="gpt2_backbone/token_embedding")

    report = PrecisionManifest("mixed_float16", (rule,)).apply(model)

    decided = {entry.path: (entry.policy, entry.decided_by) for entry in report.layers}
    # The rule beats the safe default of the model's output, at both paths.
    expected = ("mixed_bfloat16", "rules[0] (path 'gpt2_backbone/token_embedding')")
    assert decided["gpt2_backbone/token_embedding"] == decided["token_embedding"] == expected
    assert backbone.token_embedding.compute_dtype == "bfloat16"


# Saving, training -----------------------------------------------------------------


def test_saved_model_reloads_with_the_same_per_layer_policies_but_pathless_ones(tmp_path):
    model = _tiny_lm()
    manifest = PrecisionManifest.from_dict(LM_MANIFEST)
    manifest.apply(model)
    described, predictions = precision_report(model), model.predict(_tokens(), verbose=0)
    model.save(tmp_path / "model.keras")

    loaded = keras.saving.load_model(tmp_path / "model.keras")

    # Keras looks only paths up in block_0's DTypePolicyMap: the layers the
    # attention makes for itself compute in block_0's policy, its map's default.
    pathless = {"block_0/attention/_softmax", "block_0/attention/_dropout_layer"}
    after_loading = precision_report(loaded)
    # What a norm hands back to its block is not saved: loaded, it returns its float32.
    handed_back = {"block_0/attention_norm", "block_0/mlp_norm"}
    assert {entry.path for entry in described.layers if entry.returns_dtype} == handed_back
    assert [entry for entry in after_loading.layers if entry.path not in pathless] == [
        dataclasses.replace(entry, output_dtype="float32", returns_dtype=None)
        if entry.path in handed_back
        else entry
        for entry in described.layers
        if entry.path not in pathless
    ]
    assert [
        (entry.path, entry.policy, entry.compute_dtype)
        for entry in after_loading.layers
        if entry.path in pathless
    ] == [
        ("block_0/attention/_softmax", "mixed_float16", "float16"),
        ("block_0/attention/_dropout_layer", "mixed_float16", "float16"),
    ]
    assert dict(iter_layers(loaded))["block_0/attention/query"].compute_dtype == "bfloat16"
    np.testing.assert_array_equal(loaded.predict(_tokens(), verbose=0), predictions)
    manifest.apply(loaded)  # Applying again restores them.
    assert precision_report(loaded) == described


def test_a_loaded_keras_hub_backbone_needs_the_manifest_applied_again(tiny_gpt2, tmp_path):
    backbone = tiny_gpt2()
    manifest = PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_float16",
            "rules": [{"match": {"class": "Softmax"}, "policy": "float32"}],
        }
    )
    manifest.apply(backbone)
    backbone.save(tmp_path / "gpt2.keras")

    loaded = keras.saving.load_model(tmp_path / "gpt2.keras")

    # Its config holds its arguments, not its layers': loading re-creates
    # every layer in the backbone's own policy, as a subclassed model does.
    assert {entry.policy for entry in precision_report(loaded).layers} == {"float32"}
    manifest.apply(loaded)
    assert precision_report(loaded).layers == precision_report(backbone).layers
    softmax = dict(iter_layers(loaded))["transformer_layer_0/self_attention/_softmax"]
    assert softmax.compute_dtype == "float32"


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
def test_model_trains_after_apply(jit_compile):
    keras.utils.set_random_seed(0)
    model = _tiny_lm()
    PrecisionManifest.from_dict(LM_MANIFEST).apply(model)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    before = [variable.numpy() for variable in model.trainable_variables]
    tokens = _tokens(batch=8)
    history = model.fit(tokens, np.roll(tokens, -1, axis=1), batch_size=4, epochs=3, verbose=0)

    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    for variable, initial in zip(model.trainable_variables, before, strict=True):
        assert variable.dtype == "float32"
        assert np.all(np.isfinite(variable.numpy()))
        assert not np.array_equal(variable.numpy(), initial), variable.path


def test_float16_variables_are_refused():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, dtype="float16")], name="half"
    )
    with pytest.raises(UserInputError) as raised:
        PrecisionManifest(default="float32").apply(model)
    assert str(raised.value) == (
        "model 'half': variable 'half/dense/kernel' is float16; a manifest keeps variables "
        "float32. Allowed: a model built under float32, mixed_float16 or mixed_bfloat16"
    )


# The bundled manifests --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, model_name, options, dimensions, expected",
    [
        (
            "digits_cnn",
            "cnn",
            {},
            {"input_shape": (8, 8, 1), "num_classes": 10},
            {
                "conv_0": "float32",
                "conv_1": "mixed_bfloat16",
                "dense": "mixed_bfloat16",
                "logits": "float32",
            },
        ),
        (
            "python_source_transformer",
            "transformer_lm",
            {"num_layers": 2, "d_model": 64, "num_heads": 4},
            {"vocab_size": 256, "sequence_length": 64},
            {
                "token_embedding": "float32",
                "position_embedding": "float32",
                "block_1": "float32",
                "block_1/attention_norm": "float32",
                "block_1/attention/query": "mixed_bfloat16",
                "block_1/mlp_dropout": "mixed_bfloat16",  # rules reach it: the default
                "block_1/mlp_up": "mixed_bfloat16",
                "logits": "float32",
            },
        ),
    ],
)
def test_bundled_manifests_apply_cleanly(name, model_name, options, dimensions, expected):
    path = os.path.join(REPO, "configs", "manifests", f"{name}.json")
    manifest = PrecisionManifest.from_json(path)
    model = models.build_model(model_name, options, **dimensions)

    report = manifest.apply(model)

    assert report.unmatched_rules == report.shadowed_rules == ()
    assert {key: report.policies[key] for key in expected} == expected
    assert all(rule.reason for rule in manifest.rules)
    with open(path, encoding="utf-8") as file:
        assert file.read() == manifest.to_json()


# Parsing -------------------------------------------------------------------------


def test_round_trip(tmp_path):
    values = {
        "version": 1,
        "default": "mixed_bfloat16",
        "safe_defaults": False,
        "rules": [
            {"match": {"path": "a/.*", "class": "Dense"}, "policy": "float32", "reason": "why"},
            {"match": {"class": "Softmax"}, "policy": "mixed_float16"},
        ],
    }
    manifest = PrecisionManifest.from_dict(values)
    assert manifest.to_dict() == values
    assert PrecisionManifest.from_dict(json.loads(manifest.to_json())) == manifest
    text = manifest.to_json(tmp_path / "manifest.json")  # Written too: from_json reads it.
    assert (tmp_path / "manifest.json").read_text() == text == manifest.to_json()
    assert PrecisionManifest.from_json(tmp_path / "manifest.json") == manifest
    assert manifest.rules[0] == Rule(
        policy="float32", path="a/.*", layer_class="Dense", reason="why"
    )
    assert PrecisionManifest.from_dict({"version": 1, "default": "float32"}) == PrecisionManifest(
        default="float32", rules=(), safe_defaults=True, version=1
    )


def _rules(*rules):
    return json.dumps({"version": 1, "default": "float32", "rules": list(rules)})


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"version": 1, "default": "float32", "rulez": []}',
            "unknown key 'rulez'. Allowed keys: version, default, safe_defaults, rules",
        ),
        (
            _rules({"match": {"path": "x"}, "policy": "float32", "scaling": "current"}),
            'rules[0].scaling: received "current". Allowed: no scaling (it is for policy float8)',
        ),
        (
            _rules({"match": {"path": "x"}, "policy": "float8", "scaling": "eager"}),
            'rules[0].scaling: received "eager". Allowed: delayed or current',
        ),
        (
            _rules({"match": {"path": "x"}, "polcy": "float32"}),
            "unknown key 'rules[0].polcy'. "
            "Allowed keys in rules[0]: match, policy, scaling, reason",
        ),
        (
            _rules(
                {"match": {"path": "x"}, "policy": "float32"},
                {"match": {"name": "x"}, "policy": "float32"},
            ),
            "unknown key 'rules[1].match.name'. Allowed keys in rules[1].match: path, class",
        ),
        (
            _rules(
                *[{"match": {"path": "x"}, "policy": "float32"}] * 2,
                {"match": {"path": "x"}, "policy": "float16"},
            ),
            f'rules[2].policy: received "float16". {RULE_ALLOWED}',
        ),
        ('{"version": 1, "default": "bfloat16"}', f'default: received "bfloat16". {ALLOWED}'),
        # float8 is for the rules that match Dense and EinsumDense layers.
        ('{"version": 1, "default": "float8"}', f'default: received "float8". {ALLOWED}'),
        (
            _rules({"match": {"path": "block_(0"}, "policy": "float32"}),
            "rules[0].match.path: bad regex 'block_(0': missing ), unterminated subpattern at "
            "position 6",
        ),
        (
            _rules({"match": {}, "policy": "float32"}),
            "rules[0].match: empty. Allowed keys: path, class (one or both)",
        ),
        (
            _rules({"match": {"path": ""}, "policy": "float32"}),
            'rules[0].match.path: received "". Allowed: a non-empty string',
        ),
        (
            _rules({"match": {"class": 3}, "policy": "float32"}),
            "rules[0].match.class: received 3. Allowed: a non-empty string",
        ),
        (
            _rules({"match": {"path": "x"}, "policy": "float32", "reason": 3}),
            "rules[0].reason: received 3. Allowed: a string",
        ),
        (
            _rules({"match": "x", "policy": "float32"}),
            'rules[0].match: received "x". Allowed: a JSON object',
        ),
        (_rules("x"), 'rules[0]: received "x". Allowed: a JSON object'),
        (
            _rules({"match": {"path": "x"}}),
            "missing key 'rules[0].policy'. Required keys in rules[0]: match, policy",
        ),
        (
            '{"version": 1, "default": "float32", "rules": {}}',
            "rules: received {}. Allowed: a JSON array",
        ),
        ('{"version": 2, "default": "float32"}', "version: received 2. Allowed: 1"),
        ('{"version": true, "default": "float32"}', "version: received true. Allowed: 1"),
        ('{"default": "float32"}', "missing key 'version'. Required keys: version, default"),
        (
            '{"version": 1, "default": "float32", "safe_defaults": 1}',
            "safe_defaults: received 1. Allowed: true, false",
        ),
        (
            '{"version": 1,\n "default": "float32",\n}',
            "malformed JSON at line 3 column 1: Expecting property name enclosed in double quotes",
        ),
        ("[]", "expected a JSON object, received list"),
        # Found by tests/test_fuzz.py: OverflowError, RecursionError, a line break.
        (
            _rules({"match": {"path": "a{4294967296}"}, "policy": "float32"}),
            "rules[0].match.path: bad regex 'a{4294967296}': the repetition number is too large",
        ),
        (
            _rules({"match": {"path": "(" * 2000 + ")" * 2000}, "policy": "float32"}),
            f"rules[0].match.path: bad regex '{'(' * 2000 + ')' * 2000}': groups nested too deeply",
        ),
        (
            '{"version": 1, "default": "float32", "a\\u2028b": 1}',
            "unknown key 'a\\u2028b'. Allowed keys: version, default, safe_defaults, rules",
        ),
    ],
)
def test_bad_manifest_files_name_file_key_and_allowed_values(tmp_path, text, message):
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(UserInputError) as raised:
        PrecisionManifest.from_json(path)
    assert str(raised.value) == f"{path}: {message}"


def test_missing_file():
    with pytest.raises(UserInputError) as raised:
        PrecisionManifest.from_json("no/such/manifest.json")
    assert str(raised.value) == "no/such/manifest.json: no such file"


def test_from_dict_names_its_source():
    with pytest.raises(UserInputError) as raised:
        PrecisionManifest.from_dict([], source="--manifest")
    assert str(raised.value) == "--manifest: received []. Allowed: a JSON object"


# Float8 --------------------------------------------------------------------------

FLOAT8_MANIFEST = os.path.join(
    REPO, "configs", "manifests", "python_source_transformer_float8.json"
)
# The Dense and EinsumDense layers of block 0 of the tiny LM; the logits stay float32.
BLOCK_MATMULS = (
    "block_0/attention/query",
    "block_0/attention/key",
    "block_0/attention/value",
    "block_0/attention/attention_output",
    "block_0/mlp_up",
    "block_0/mlp_down",
)


def _float8_lm():
    model = _tiny_lm()
    report = PrecisionManifest.from_json(FLOAT8_MANIFEST).apply(model)
    return model, report


def test_float8_layers_train_their_matmuls_in_float8_and_compute_in_the_default():
    model, report = _float8_lm()
    float8 = {
        layer.path: (layer.policy, layer.compute_dtype, layer.decided_by)
        for layer in report.layers
        if layer.policy.startswith("float8")
    }
    rule = (
        "rules[2] (path 'block_\\d+/(attention/(query|key|value|attention_output)"
        "|mlp_up|mlp_down)')"
    )
    assert float8 == {
        path: ("float8_from_mixed_bfloat16", "bfloat16", rule) for path in BLOCK_MATMULS
    }
    assert report.policies["logits"] == "float32"
    layers = dict(iter_layers(model))
    assert [path for path in BLOCK_MATMULS if layers[path].quantization_mode == "float8"] == list(
        BLOCK_MATMULS
    )


def test_float8_layers_train_and_a_second_apply_keeps_their_state():
    model, report = _float8_lm()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    tokens = _tokens(8)
    model.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
    layers = dict(iter_layers(model))
    scale = layers["block_0/mlp_up"].inputs_scale
    assert float(scale.numpy()) != 1.0  # Two steps: the history moved the scale.
    before = [variable.numpy().copy() for variable in model.weights]
    again = PrecisionManifest.from_json(FLOAT8_MANIFEST).apply(model)
    assert again.policies == report.policies
    assert layers["block_0/mlp_up"].inputs_scale is scale
    for a, b in zip(before, [variable.numpy() for variable in model.weights], strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_rule_with_current_scaling_scales_each_step_by_its_own_amax():
    """Current scaling writes the scale it used: this step's amax over e4m3's largest (448)."""
    with open(FLOAT8_MANIFEST) as file:
        manifest = json.load(file)
    for rule in manifest["rules"]:
        if rule["policy"] == "float8":
            rule["scaling"] = "current"
    model = _tiny_lm()
    assert PrecisionManifest.from_dict(manifest).to_dict() == manifest  # The key round-trips.
    PrecisionManifest.from_dict(manifest).apply(model)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    tokens = _tokens(4)
    model.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
    layer = dict(iter_layers(model))["block_0/mlp_up"]
    amax = float(layer.inputs_amax_history.numpy()[0])
    assert amax > 0
    assert float(layer.inputs_scale.numpy()) == pytest.approx(amax / 448.0, rel=1e-6)
    # Delayed scaling, after one step, still scales by the first value (1.0).
    delayed = _tiny_lm()
    PrecisionManifest.from_json(FLOAT8_MANIFEST).apply(delayed)
    delayed.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    delayed.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
    assert float(dict(iter_layers(delayed))["block_0/mlp_up"].inputs_scale.numpy()) == 1.0


def test_a_saved_float8_model_loads_with_its_float8_state(tmp_path):
    model, _ = _float8_lm()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    tokens = _tokens(8)
    model.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    policies = precision_report(loaded).policies
    assert {path: policies[path] for path in BLOCK_MATMULS} == {
        path: "float8_from_mixed_bfloat16" for path in BLOCK_MATMULS
    }
    # A loaded float8 layer lists its float8 state before its kernel: by path.
    saved = {variable.path: variable.numpy() for variable in model.weights}
    restored = {variable.path: variable.numpy() for variable in loaded.weights}
    assert sorted(restored) == sorted(saved)
    for path, value in saved.items():
        np.testing.assert_array_equal(restored[path], value)


def test_float8_for_another_layer_class_is_one_line_naming_it():
    manifest = PrecisionManifest(
        default="mixed_bfloat16", rules=(Rule("float8", path="block_0/(mlp_up|attention_norm)"),)
    )
    model = _tiny_lm()
    before = precision_report(model, trace=False).policies
    with pytest.raises(UserInputError) as raised:
        manifest.apply(model)
    assert str(raised.value) == (
        "layer 'block_0/attention_norm': LayerNormalization cannot train in float8. "
        "Allowed: Dense, EinsumDense (Keras' own, not subclasses)"
    )
    assert precision_report(model, trace=False).policies == before  # Nothing was set.


def test_float8_needs_the_layer_built():
    model = keras.Sequential([keras.layers.Dense(4, name="hidden"), keras.layers.Dense(2)])
    manifest = PrecisionManifest(default="mixed_bfloat16", rules=(Rule("float8", path="hidden"),))
    with pytest.raises(UserInputError) as raised:
        manifest.apply(model)
    assert str(raised.value) == (
        "layer 'hidden': not built, and the manifest has float8 rules, which need every "
        "layer built (a layer creates some of its sublayers when it is built). Build the "
        "model (call it on a batch) before applying the manifest"
    )


def test_a_keras_hub_backbone_trains_with_float8_matmuls(tiny_gpt2):
    backbone = tiny_gpt2()
    manifest = PrecisionManifest.from_dict(
        {
            "version": 1,
            "default": "mixed_bfloat16",
            "rules": [
                {"match": {"class": "EinsumDense"}, "policy": "float8"},
                {"match": {"path": ".*_dense"}, "policy": "float8"},
            ],
        }
    )
    report = manifest.apply(backbone)
    assert [layer.path for layer in report.layers if layer.policy.startswith("float8")] == [
        f"transformer_layer_{index}/{name}"
        for index in range(2)
        for name in (
            "self_attention/query",
            "self_attention/key",
            "self_attention/value",
            "self_attention/attention_output",
            "feedforward_intermediate_dense",
            "feedforward_output_dense",
        )
    ]
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, (8, 16)).astype("int32"),
        "padding_mask": np.ones((8, 16), "int32"),
    }
    backbone.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    history = backbone.fit(x, rng.normal(size=(8, 16, 16)), batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    query = dict(iter_layers(backbone))["transformer_layer_0/self_attention/query"]
    assert float(query.inputs_amax_history[0]) > 0  # Keras' float8 state moved.


def test_a_layer_shared_by_two_models_turns_to_float8_once():
    shared = keras.layers.Dense(4, name="shared")
    inner_inputs = keras.Input((4,))
    inner = keras.Model(inner_inputs, shared(inner_inputs), name="inner")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(shared(inner(inputs))))
    manifest = PrecisionManifest(default="mixed_bfloat16", rules=(Rule("float8", path="shared"),))
    report = manifest.apply(model)
    assert shared.quantization_mode == "float8"
    assert {path: report.policies[path] for path in ("shared", "inner/shared")} == {
        "shared": "float8_from_mixed_bfloat16",
        "inner/shared": "float8_from_mixed_bfloat16",
    }

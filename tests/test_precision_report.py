"""Tests of mpt_keras.precision.report: each layer's policy, dtypes and output dtype."""

import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras import models
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import LayerPrecision, PrecisionReport, precision_report


def test_report_lists_every_layer_with_compute_and_variable_dtype():
    with global_policy("mixed_float16"):
        model = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
    report = precision_report(model)
    assert report.model == "cnn"
    assert [entry.path for entry in report.layers] == [
        "conv_0",
        "pool_0",
        "conv_1",
        "pool_1",
        "flatten",
        "dense",
        "dropout",
        "logits",
    ]
    assert report.layers[0] == LayerPrecision(
        path="conv_0",
        layer_class="Conv2D",
        policy="mixed_float16",
        compute_dtype="float16",
        variable_dtype="float32",
        output_dtype="float16",
        decided_by=None,
        reason=None,
    )
    assert report.trainable_variables == {"float32": 8}
    # No layer makes another dtype than it computes in: the Dense layers output float16.
    assert {entry.output_dtype for entry in report.layers} == {"float16"}
    assert report.output_dtype_mismatches == ()


def test_report_names_the_policy_a_policy_map_gives_each_layer():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="dense")
    dropout = keras.layers.Dropout(0.1, name="dropout")
    model = keras.Model(inputs, dropout(dense(inputs)))
    policy_map = keras.dtype_policies.DTypePolicyMap(
        default_policy=keras.DTypePolicy("mixed_float16"),
        policy_map={"dense": keras.DTypePolicy("mixed_bfloat16")},
    )
    dense.dtype_policy = dropout.dtype_policy = policy_map
    layers = precision_report(model).layers
    assert [(entry.path, entry.policy, entry.compute_dtype) for entry in layers] == [
        ("dense", "mixed_bfloat16", "bfloat16"),
        ("dropout", "mixed_float16", "float16"),  # no path: the map's default
    ]


# Output dtypes ----------------------------------------------------------------------


class _Upcast(keras.layers.Layer):
    """Mixes a float32 NumPy constant into its input: outputs float32 whatever its policy."""

    def call(self, inputs):
        return keras.ops.multiply(inputs, np.full((4,), 2.0, "float32"))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.hidden = keras.layers.Dense(4, name="hidden")
        self.scale = _Upcast(name="scale")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, inputs):
        return self.head(self.scale(self.hidden(inputs)))


def _plain():
    inputs = keras.Input((3,))
    scaled = _Upcast(name="scale")(keras.layers.Dense(4, name="hidden")(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(scaled))


def _nested():
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), _Upcast(name="scale")],
        name="inner",
    )
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(inner(inputs)))


def _subclassed():
    model = _Subclassed()
    model(np.zeros((1, 3), "float32"))
    return model


def _dtypes(report):
    return [(e.path, e.compute_dtype, e.output_dtype) for e in report.layers]


@pytest.mark.parametrize(
    "build, inputs, expected, flagged",
    [
        (
            _plain,
            None,
            [
                ("hidden", "bfloat16", "bfloat16"),
                ("scale", "bfloat16", "float32"),
                ("head", "bfloat16", "bfloat16"),  # Dense casts its input back
            ],
            ["scale"],
        ),
        (
            _nested,
            None,
            [
                # The sub-model returns its layer's float32: not its own mismatch.
                ("inner", "bfloat16", "float32"),
                ("inner/hidden", "bfloat16", "bfloat16"),
                ("inner/scale", "bfloat16", "float32"),
                ("head", "bfloat16", "bfloat16"),
            ],
            ["inner/scale"],
        ),
        (
            _subclassed,
            np.zeros((1, 3), "float32"),
            [
                ("hidden", "bfloat16", "bfloat16"),
                ("scale", "bfloat16", "float32"),
                ("head", "bfloat16", "bfloat16"),
            ],
            ["scale"],
        ),
        (
            _subclassed,
            tf.TensorSpec((None, 3), "float32"),
            [
                ("hidden", "bfloat16", "bfloat16"),
                ("scale", "bfloat16", "float32"),
                ("head", "bfloat16", "bfloat16"),
            ],
            ["scale"],
        ),
        (
            # No inputs of its own to trace it on: nothing known, nothing flagged.
            _subclassed,
            None,
            [
                ("hidden", "bfloat16", None),
                ("scale", "bfloat16", None),
                ("head", "bfloat16", None),
            ],
            [],
        ),
    ],
    ids=["plain", "nested", "subclassed_array", "subclassed_spec", "subclassed_no_inputs"],
)
def test_a_layer_mixing_in_a_float32_numpy_constant_is_flagged(build, inputs, expected, flagged):
    with global_policy("mixed_bfloat16"):
        model = build()
    report = precision_report(model, inputs)
    assert _dtypes(report) == expected
    assert report.output_dtype_mismatches == tuple(flagged)


def test_without_the_trace_every_output_dtype_is_none_and_no_call_runs():
    calls = []

    class Counted(keras.layers.Layer):
        def call(self, inputs):
            calls.append(1)
            return inputs * 2.0

    inputs = keras.Input((3,))
    with global_policy("mixed_bfloat16"):
        model = keras.Model(inputs, Counted(name="counted")(keras.layers.Dense(2)(inputs)))
    calls.clear()
    report = precision_report(model, trace=False)
    assert calls == []
    assert [(layer.path, layer.compute_dtype, layer.output_dtype) for layer in report.layers] == [
        ("dense", "bfloat16", None),
        ("counted", "bfloat16", None),
    ]
    assert precision_report(model).layers[1].output_dtype == "bfloat16" and calls == [1]


class _Half(keras.layers.Layer):
    def call(self, inputs):
        return keras.ops.cast(inputs, "float16")


class _Argmax(keras.layers.Layer):
    def call(self, inputs):
        return keras.ops.argmax(inputs, axis=-1)


def test_a_float32_layer_making_float16_is_flagged_and_integer_outputs_are_not():
    inputs = keras.Input((3,))
    with global_policy("mixed_bfloat16"):
        hidden = keras.layers.Dense(4, name="hidden")(inputs)
        unused = keras.layers.Dense(4, name="unused")
        unused.build((None, 4))
        half = _Half(dtype="float32", name="half")(hidden)
        model = keras.Model(inputs, [_Argmax(name="argmax")(half), half])
        model.unused = unused
    report = precision_report(model)
    assert _dtypes(report) == [
        ("hidden", "bfloat16", "bfloat16"),
        ("half", "float32", "float16"),
        ("argmax", "bfloat16", "int32"),  # Integer: not compared.
        ("unused", "bfloat16", None),  # Not called.
    ]
    assert report.output_dtype_mismatches == ("half",)


def _state(model):
    """Everything set on the model and its layers, by identity, and their losses."""
    layers = [model, *(layer for _, layer in iter_layers(model))]
    return [
        ({key: id(value) for key, value in vars(layer).items()}, [id(x) for x in layer.losses])
        for layer in layers
    ]


class _Regularized(keras.layers.Layer):
    """Adds an activity loss; fails when told to."""

    def __init__(self, **kwargs):
        super().__init__(activity_regularizer="l2", **kwargs)
        self.fail = False

    def call(self, inputs):
        if self.fail:
            raise ValueError("no graph for me")
        return inputs * 2.0


def test_the_trace_leaves_the_model_exactly_as_it_was_even_on_error(caplog):
    inputs = keras.Input((3,))
    with global_policy("mixed_float16"):
        regularized = _Regularized(name="regularized")
        inner = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5)], name="inner")
        hidden = keras.layers.Dense(3, name="dense")(inputs)
        model = keras.Model(inputs, inner(regularized(hidden)), name="model")
    model(np.ones((2, 3), "float32"))  # Its eager activity loss stays model.losses.
    own_call = regularized.call  # An instance attribute of the layer's own: kept as it is.
    regularized.call = own_call
    before = _state(model)

    report = precision_report(model)
    assert _dtypes(report) == [
        ("dense", "float16", "float16"),
        ("regularized", "float16", "float16"),
        ("inner", "float16", "float16"),
        ("inner/dropout", "float16", "float16"),
    ]
    assert _state(model) == before
    assert vars(regularized)["call"] is own_call
    assert "call" not in vars(dict(iter_layers(model))["dense"])

    regularized.fail = True
    with caplog.at_level(logging.WARNING, logger="mpt_keras.precision.report"):
        failed = precision_report(model)
    assert [entry.output_dtype for entry in failed.layers] == [None] * 4
    assert failed.output_dtype_mismatches == ()
    line = _Regularized.call.__code__.co_firstlineno + 2
    assert caplog.messages == [
        "Model model: not traced to find each layer's output dtype "
        f"(ValueError: no graph for me ({__file__}, line {line}))"
    ]
    regularized.fail = False
    assert _state(model) == before


# The JSON form and the table ------------------------------------------------------


def _run_report():
    """A run's report: decisions, a mismatch, an unmatched rule, the run's settings."""
    return PrecisionReport(
        model="tiny",
        layers=(
            LayerPrecision(
                "hidden", "Dense", "mixed_bfloat16", "bfloat16", "float32", "bfloat16", "default"
            ),
            LayerPrecision(
                "scale",
                "Scale",
                "mixed_bfloat16",
                "bfloat16",
                "float32",
                "float32",
                "rules[0] (class 'Scale')",
                "measured",
            ),
        ),
        trainable_variables={"float32": 2},
        output_dtype_mismatches=("scale",),
        unmatched_rules=("rules[1] (path 'head')",),
        precision="mixed_bfloat16",
        manifest="manifest.json",
        jit_compile=False,
        jit_compile_reason="jit_compile=false: as set",
    )


def test_to_dict_is_what_precision_report_json_holds():
    values = _run_report().to_dict()
    assert values == {
        "precision": "mixed_bfloat16",
        "precision_reason": None,
        "manifest": "manifest.json",
        "model": "tiny",
        "layers": [
            {
                "path": "hidden",
                "class": "Dense",
                "policy": "mixed_bfloat16",
                "compute_dtype": "bfloat16",
                "variable_dtype": "float32",
                "output_dtype": "bfloat16",
                "decided_by": "default",
                "reason": None,
                "returns_dtype": None,
            },
            {
                "path": "scale",
                "class": "Scale",
                "policy": "mixed_bfloat16",
                "compute_dtype": "bfloat16",
                "variable_dtype": "float32",
                "output_dtype": "float32",
                "decided_by": "rules[0] (class 'Scale')",
                "reason": "measured",
                "returns_dtype": None,
            },
        ],
        "trainable_variables": {"float32": 2},
        "output_dtype_mismatches": ["scale"],
        "unmatched_rules": ["rules[1] (path 'head')"],
        "shadowed_rules": [],
        "jit_compile": False,
        "jit_compile_reason": "jit_compile=false: as set",
        "float8_census": None,
    }
    assert json.loads(json.dumps(values)) == values
    assert _run_report().policies == {"hidden": "mixed_bfloat16", "scale": "mixed_bfloat16"}


def test_format_table_aligns_the_columns_and_marks_a_mismatch():
    assert _run_report().format_table() == (
        "path    class  policy          decided_by\n"
        "hidden  Dense  mixed_bfloat16  default\n"
        "scale   Scale  mixed_bfloat16  rules[0] (class 'Scale')  "
        "<- outputs float32, computes in bfloat16\n"
    )


def test_format_table_of_a_report_that_decided_nothing():
    with global_policy("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    assert precision_report(model).format_table() == (
        "path   class  policy         decided_by\ndense  Dense  mixed_float16\n"
    )

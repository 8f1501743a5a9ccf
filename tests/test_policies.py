"""Tests of mpt_keras.policies (the global policy scope, the precision report)
and of mpt_keras.layer_paths (the paths in it, and their forms)."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.layer_paths import first_instance_name, iter_layer_paths
from mpt_keras.policies import (
    HardwareProbe,
    global_policy,
    iter_layers,
    precision_report,
    probe_hardware,
    resolve_auto_policy,
)


def test_global_policy_applies_inside_and_restores_after():
    with global_policy("mixed_bfloat16"):
        layer = keras.layers.Dense(2)
    assert layer.compute_dtype == "bfloat16"
    assert layer.variable_dtype == "float32"
    assert keras.config.dtype_policy().name == "float32"


def test_global_policy_restores_on_error():
    with pytest.raises(RuntimeError):
        with global_policy("mixed_float16"):
            raise RuntimeError
    assert keras.config.dtype_policy().name == "float32"


def test_unknown_policy():
    with pytest.raises(UserInputError) as raised:
        with global_policy("float16"):
            pass
    assert str(raised.value) == (
        "precision: unknown policy 'float16'. Allowed: float32, mixed_float16, mixed_bfloat16"
    )


def test_report_lists_every_layer_with_compute_and_variable_dtype():
    with global_policy("mixed_float16"):
        model = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
    report = precision_report(model)
    assert report["model"] == "cnn"
    assert [entry["path"] for entry in report["layers"]] == [
        "conv_0",
        "pool_0",
        "conv_1",
        "pool_1",
        "flatten",
        "dense",
        "dropout",
        "logits",
    ]
    assert report["layers"][0] == {
        "path": "conv_0",
        "class": "Conv2D",
        "policy": "mixed_float16",
        "compute_dtype": "float16",
        "variable_dtype": "float32",
        "output_dtype": "float16",
    }
    assert report["trainable_variables"] == {"float32": 8}
    # No layer makes another dtype than it computes in: the Dense layers output float16.
    assert {entry["output_dtype"] for entry in report["layers"]} == {"float16"}
    assert report["output_dtype_mismatches"] == []


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
    layers = precision_report(model)["layers"]
    assert [(entry["path"], entry["policy"], entry["compute_dtype"]) for entry in layers] == [
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
    return [(e["path"], e["compute_dtype"], e["output_dtype"]) for e in report["layers"]]


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
    assert report["output_dtype_mismatches"] == flagged


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
    assert report["output_dtype_mismatches"] == ["half"]


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
    with caplog.at_level(logging.WARNING, logger="mpt_keras.policies"):
        failed = precision_report(model)
    assert [entry["output_dtype"] for entry in failed["layers"]] == [None] * 4
    assert failed["output_dtype_mismatches"] == []
    line = _Regularized.call.__code__.co_firstlineno + 2
    assert caplog.messages == [
        "Model model: not traced to find each layer's output dtype "
        f"(ValueError: no graph for me ({__file__}, line {line}))"
    ]
    regularized.fail = False
    assert _state(model) == before


# Layer paths ----------------------------------------------------------------------


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
    assert [entry["path"] for entry in precision_report(model)["layers"]][8:10] == [
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


@pytest.mark.parametrize(
    "probe, policy, reason",
    [
        (
            HardwareProbe(tpu=True, gpu_compute_capabilities=((7, 0),)),
            "mixed_bfloat16",
            "TPU: bfloat16 is the native type of its matrix units",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((9, 0),)),
            "mixed_bfloat16",
            "GPU compute capability 9.0: bfloat16 tensor cores",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((8, 0), (8, 6))),
            "mixed_bfloat16",
            "GPU compute capability 8.0: bfloat16 tensor cores",
        ),
        (
            HardwareProbe(
                gpu_compute_capabilities=((8, 6), (7, 5)), cpu_flags=frozenset({"avx512_bf16"})
            ),
            "mixed_float16",
            "GPU compute capability 7.5: float16 tensor cores, no bfloat16 ones (needs 8.0)",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((7, 0),)),
            "mixed_float16",
            "GPU compute capability 7.0: float16 tensor cores, no bfloat16 ones (needs 8.0)",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((6, 1),)),
            "float32",
            "GPU compute capability 6.1: no tensor cores (needs 7.0)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"avx2", "avx512_bf16"})),
            "mixed_bfloat16",
            "no GPU or TPU; CPU computes bfloat16 (avx512_bf16)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})),
            "mixed_bfloat16",
            "no GPU or TPU; CPU computes bfloat16 (avx512_bf16, amx_bf16)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"avx2", "amx_tile"})),
            "float32",
            "no GPU or TPU, and the CPU lacks bfloat16 instructions (avx512_bf16 or amx_bf16)",
        ),
        (
            HardwareProbe(),
            "float32",
            "no GPU or TPU, and the CPU lacks bfloat16 instructions (avx512_bf16 or amx_bf16)",
        ),
    ],
    ids=[
        "tpu",
        "gpu_9.0",
        "gpus_8.x",
        "lowest_gpu_decides",
        "gpu_7.0",
        "gpu_6.1",
        "cpu_avx512",
        "cpu_amx",
        "cpu_amx_tile_only",
        "nothing",
    ],
)
def test_resolve_auto_policy(probe, policy, reason):
    assert resolve_auto_policy(probe) == (policy, reason)


def test_probe_reads_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    assert probe_hardware(str(cpuinfo)).cpu_flags == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert probe_hardware(str(tmp_path / "missing")).cpu_flags == frozenset()


def _machine_has(flag):
    try:
        with open("/proc/cpuinfo") as file:
            return flag in file.read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _machine_has("avx512_bf16"), reason="this CPU lacks avx512_bf16")
def test_probe_finds_this_machines_bfloat16_cpu():
    probe = probe_hardware()
    assert "avx512_bf16" in probe.cpu_flags
    assert resolve_auto_policy() == resolve_auto_policy(probe)  # probes when not given one

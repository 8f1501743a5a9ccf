"""Tests of mpt_keras.runs.serving: a serving file that loads without mpt_keras, a SavedModel."""

import io
import json
import os
import subprocess
import sys
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import mpt_keras
from mpt_keras.models.transformer import build_transformer_lm
from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import precision_report
from mpt_keras.runs import serving

# Run in a fresh Python that never imports mpt_keras: `sys.modules[name] = None`
# makes every `import mpt_keras...` raise ImportError. Loads the serving file
# (recording every warning) and the full model.keras, and prints what it saw as
# one JSON line.
_LOAD_WITHOUT_MPT_KERAS = r"""
import json, sys, warnings
sys.modules["mpt_keras"] = None
import keras
import numpy as np

serving_path, full_path, inputs_path = sys.argv[1:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = keras.saving.load_model(serving_path)
try:
    keras.saving.load_model(full_path)
    full_model_error = None
except Exception as error:
    full_model_error = str(error).splitlines()[0]
layers = {}
for layer in model.layers:
    if isinstance(layer, keras.layers.InputLayer):
        continue
    policy = layer.dtype_policy
    layers[layer.name] = {
        "compute_dtype": layer.compute_dtype,
        "policy": {path: p.name for path, p in policy.items()}
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        else policy.name,
    }
print(json.dumps({
    "predictions": model.predict(np.load(inputs_path), verbose=0).tolist(),
    "layers": layers,
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "compiled": model.compiled,
    "full_model_error": full_model_error,
    "mpt_keras_imported": [name for name, m in sys.modules.items()
                           if name.startswith("mpt_keras") and m is not None],
}))
"""

_ATTENTION_POLICIES = {
    "attention": "mixed_float16",
    "attention/query": "mixed_float16",
    "attention/key": "mixed_float16",
    "attention/value": "mixed_float16",
    "attention/attention_output": "float32",
}


def _inputs(count: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).normal(size=(count, 3, 4)).astype("float32")


def _fit_two_steps(model: keras.Model, learning_rate=1e-3) -> None:
    model.compile(
        # A scale that does not overflow these float16 gradients: both steps apply.
        optimizer=mpt_keras.LossScaleOptimizer(
            keras.optimizers.Adam(learning_rate), initial_scale=2.0**8
        ),
        loss="mse",
    )
    targets = np.random.RandomState(1).normal(size=(8, 2)).astype("float32")
    model.fit(_inputs(), targets, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert model.optimizer.skipped_steps == 0


def _trained_functional_model(learning_rate=1e-3) -> keras.Model:
    """A mixed_float16 model with a manifest (a DTypePolicyMap on `attention`), 2 steps trained."""
    with global_policy("mixed_float16"):
        inputs = keras.Input((3, 4), name="tokens")
        hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
        attended = keras.layers.MultiHeadAttention(2, 4, name="attention")(hidden, hidden)
        normed = keras.layers.LayerNormalization(name="norm")(attended)
        flat = keras.layers.Flatten(name="flatten")(normed)
        logits = keras.layers.Dense(2, name="logits")(flat)
        model = keras.Model(inputs, logits, name="tiny")
    manifest = mpt_keras.PrecisionManifest(
        default="mixed_float16",
        rules=(mpt_keras.Rule("float32", path="attention/attention_output"),),
    )
    manifest.apply(model)
    _fit_two_steps(model, learning_rate)
    return model


def _archive(path) -> tuple[dict, list[str], list[str]]:
    """The config, the zip entries and the weights' top-level groups of a .keras file."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
        with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
            groups = sorted(weights)
        return config, sorted(archive.namelist()), groups


def test_serving_file_loads_and_predicts_in_a_process_without_mpt_keras(tmp_path):
    model = _trained_functional_model()
    weights = model.get_weights()
    optimizer = model.optimizer
    full_path = tmp_path / "model.keras"
    model.save(full_path)
    serving_path = tmp_path / serving.SERVING_MODEL_FILE

    serving.save_for_serving(model, serving_path)

    inputs = _inputs(5, seed=2)
    np.save(tmp_path / "inputs.npy", inputs)
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_WITHOUT_MPT_KERAS,
            str(serving_path),
            str(full_path),
            str(tmp_path / "inputs.npy"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300,
    )
    assert process.returncode == 0, process.stderr
    seen = json.loads(process.stdout.strip().splitlines()[-1])
    assert seen["mpt_keras_imported"] == []
    # The guard works: the file with our optimizer does not load there.
    assert seen["full_model_error"].startswith("Could not locate class 'LossScaleOptimizer'")
    assert seen["warnings"] == []
    assert seen["compiled"] is False
    assert seen["layers"] == {
        "hidden": {"compute_dtype": "float16", "policy": "mixed_float16"},
        "attention": {"compute_dtype": "float16", "policy": _ATTENTION_POLICIES},
        "norm": {"compute_dtype": "float32", "policy": "float32"},
        "flatten": {"compute_dtype": "float16", "policy": "mixed_float16"},
        "logits": {"compute_dtype": "float32", "policy": "float32"},
    }
    # The same weights and dtypes on the same CPU: the same numbers.
    np.testing.assert_allclose(
        np.array(seen["predictions"], dtype="float32"),
        model.predict(inputs, verbose=0),
        rtol=1e-6,
        atol=1e-6,
    )
    # The trainer's model is untouched and trains on.
    assert model.optimizer is optimizer and model.compiled
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)
    model.fit(_inputs(), np.zeros((8, 2), "float32"), batch_size=4, verbose=0)
    assert int(optimizer.iterations.numpy()) == 4


def test_serving_file_holds_no_training_state_and_nothing_of_mpt_keras(tmp_path):
    model = _trained_functional_model(mpt_keras.ScaledLearningRate(1e-3, scale=0.5))
    model.save(tmp_path / "model.keras")
    full_config, full_entries, full_groups = _archive(tmp_path / "model.keras")
    assert "mpt_keras" in json.dumps(full_config)  # What the serving file must lose.

    serving.save_for_serving(model, tmp_path / "serving.keras")

    config, entries, groups = _archive(tmp_path / "serving.keras")
    assert "mpt_keras" not in json.dumps(config)
    assert "compile_config" not in config
    assert entries == full_entries == ["config.json", "metadata.json", "model.weights.h5"]
    assert groups == sorted(set(full_groups) - {"optimizer"})
    # Written through a temporary name that is gone.
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "serving.keras"]


def test_loading_a_model_saved_with_our_optimizer_warns_nothing(tmp_path):
    model = _trained_functional_model(mpt_keras.ScaledLearningRate(1e-3, scale=0.5))
    model.save(tmp_path / "model.keras")

    # Independent of the test configuration's filters (setup.cfg ignores
    # DeprecationWarning): every warning is recorded.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(tmp_path / "model.keras")
        serving.save_for_serving(loaded, tmp_path / "serving.keras")
        keras.saving.load_model(tmp_path / "serving.keras")

    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] == []
    assert isinstance(loaded.optimizer, mpt_keras.LossScaleOptimizer)
    assert loaded.optimizer.loss_scale == 2.0**8
    # The ScaledLearningRate's lowered scale came back: 1e-3 * 0.5.
    assert float(loaded.optimizer.inner_optimizer.learning_rate) == pytest.approx(5e-4)


def test_saving_our_learning_rate_schedule_warns_nothing():
    # Its config is written on every save of a run's optimizer; save_for_serving's
    # filter for Keras' own variable writes would hide this one.
    schedule = mpt_keras.ScaledLearningRate(1e-3, scale=0.5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = schedule.get_config()

    assert [str(w.message) for w in caught] == []
    assert config == {"learning_rate": 1e-3, "scale": 0.5}


def test_export_saved_model_serves_the_model_outputs_and_replaces_an_earlier_export(tmp_path):
    model = _trained_functional_model()
    directory = tmp_path / serving.SAVED_MODEL_DIR
    serving.export_saved_model(model, directory)
    first_outputs = model.predict(_inputs(5, seed=2), verbose=0)
    # Train on, export again over the first export.
    model.fit(_inputs(), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    inputs = _inputs(5, seed=2)
    outputs = model.predict(inputs, verbose=0)
    assert not np.allclose(outputs, first_outputs)

    serving.export_saved_model(model, directory)

    assert sorted(os.listdir(tmp_path)) == [serving.SAVED_MODEL_DIR]
    served = tf.saved_model.load(str(directory))
    result = served.serve(tf.constant(inputs))
    assert result.dtype == tf.float32
    # float16 layers: one float16 rounding apart at most (graph vs. eager order).
    np.testing.assert_allclose(result.numpy(), outputs, rtol=2**-10, atol=2**-10)
    assert len(served.variables) == len(model.weights)


@keras.saving.register_keras_serializable(package="serving_test")
class _PolicyPassingModel(keras.Model):
    """A subclassed model whose layers take the model's own policy."""

    def __init__(self, units: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(8, activation="relu", dtype=self.dtype_policy)
        self.logits = keras.layers.Dense(units, dtype=self.dtype_policy)

    def call(self, inputs):
        return self.logits(self.hidden(keras.ops.reshape(inputs, (-1, 12))))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_subclassed_model_that_passes_its_policy_saves_for_serving(tmp_path):
    model = _PolicyPassingModel(dtype="mixed_float16", name="subclassed")
    _fit_two_steps(model)

    serving.save_for_serving(model, tmp_path / "serving.keras")

    config, _, groups = _archive(tmp_path / "serving.keras")
    assert "mpt_keras" not in json.dumps(config)
    assert "optimizer" not in groups
    loaded = keras.saving.load_model(tmp_path / "serving.keras")
    assert [layer.compute_dtype for layer in precision_report(loaded).layers] == [
        "float16",
        "float16",
    ]
    inputs = _inputs(5, seed=2)
    np.testing.assert_array_equal(
        loaded.predict(inputs, verbose=0), model.predict(inputs, verbose=0)
    )


def test_a_backbone_model_under_a_head_saves_for_serving_though_it_loads_float32(tmp_path):
    # Keras saves no dtype for a nested functional model (it computes nothing in its own):
    # loaded it is float32, its layers as trained.
    inner = keras.Input((4,))
    backbone = keras.Model(inner, keras.layers.Dense(3, name="features")(inner), name="backbone")
    outer = keras.Input((4,))
    model = keras.Model(outer, keras.layers.Dense(2, name="logits")(backbone(outer)), name="head")
    mpt_keras.PrecisionManifest(default="mixed_float16").apply(model)

    serving.save_for_serving(model, tmp_path / "serving.keras")

    loaded = keras.saving.load_model(tmp_path / "serving.keras")
    policies = {layer.path: layer.policy for layer in precision_report(loaded).layers}
    assert policies == {
        "backbone": "float32",
        "backbone/features": "mixed_float16",
        "logits": "float32",
    }
    assert precision_report(model).layers[0].policy == "mixed_float16"
    inputs = _inputs(5, seed=2)[:, 0]
    np.testing.assert_array_equal(
        loaded.predict(inputs, verbose=0), model.predict(inputs, verbose=0)
    )


def test_subclassed_model_with_a_per_layer_manifest_is_refused(tmp_path):
    model = _PolicyPassingModel(dtype="mixed_float16", name="subclassed")
    _fit_two_steps(model)
    # The safe default makes the output layer float32; the model's __init__
    # would re-create it in the model's policy, mixed_float16.
    mpt_keras.PrecisionManifest(default="mixed_float16").apply(model)
    output_layer = model.logits.name

    with pytest.raises(serving.NotServableError) as raised:
        serving.save_for_serving(model, tmp_path / "serving.keras")

    assert str(raised.value) == (
        f"Cannot save model 'subclassed' for serving: layer '{output_layer}' would compute "
        "in float16 (Dense, float32 variables) once loaded, not float32 (Dense, float32 "
        "variables) as trained (a subclassed model must create it with its policy, e.g. "
        "dtype=self.dtype_policy; or serve the SavedModel of export_saved_model)"
    )
    assert os.listdir(tmp_path) == []


def test_model_with_layers_of_mpt_keras_is_refused(tmp_path):
    model = build_transformer_lm(16, 4, num_layers=1, d_model=8, num_heads=2)

    with pytest.raises(serving.NotServableError) as raised:
        serving.save_for_serving(model, tmp_path / "serving.keras")

    assert str(raised.value) == (
        "Cannot save model 'transformer_lm' for serving: mpt_keras>PositionEmbedding "
        "'position_embedding' (at config.layers[2]) loads only where mpt_keras is "
        "installed; serve the SavedModel of export_saved_model instead"
    )
    assert os.listdir(tmp_path) == []


class _UnregisteredLayer(keras.layers.Layer):
    def call(self, inputs):
        return inputs


def test_a_file_that_does_not_load_back_is_refused(tmp_path):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, _UnregisteredLayer(name="mine")(inputs), name="unloadable")

    with pytest.raises(serving.NotServableError) as raised:
        serving.save_for_serving(model, tmp_path / "serving.keras")

    assert str(raised.value) == (
        "Cannot save model 'unloadable' for serving: the written file does not load back "
        "(TypeError: Could not locate class '_UnregisteredLayer')"
    )
    assert os.listdir(tmp_path) == []


def test_save_for_serving_needs_a_keras_suffix(tmp_path):
    model = _trained_functional_model()
    path = str(tmp_path / "serving.h5")

    with pytest.raises(ValueError) as raised:
        serving.save_for_serving(model, path)

    assert str(raised.value) == (
        f"A serving model file must end in .keras. Received: path={path!r}"
    )


@pytest.mark.parametrize("write", [serving.save_for_serving, serving.export_saved_model])
def test_an_unbuilt_model_is_refused(tmp_path, write):
    model = keras.Sequential([keras.layers.Dense(2)], name="unbuilt")

    with pytest.raises(ValueError) as raised:
        write(model, tmp_path / "serving.keras")

    assert str(raised.value) == (
        "Model 'unbuilt' is not built: call it on a batch or build it before saving it for serving"
    )


# Weights that do not hang on what earlier tests drew (a few draws would round alike).
_SEEDED = keras.initializers.GlorotUniform(seed=7)


@keras.saving.register_keras_serializable(package="tests")
class _NormBlock(keras.layers.Layer):
    """Post-norm (`normed + dense(normed)` by `keras.ops.add`, which promotes mixed dtypes on
    both backends) or pre-norm (`inputs + dense(norm(inputs))`)."""

    def __init__(self, post_norm: bool, initializer=_SEEDED, **kwargs):
        super().__init__(**kwargs)
        self.post_norm = post_norm
        self.norm = keras.layers.LayerNormalization(name="norm", dtype=self.dtype_policy)
        self.dense = keras.layers.Dense(
            4, name="dense", dtype=self.dtype_policy, kernel_initializer=initializer
        )

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.dense.build(input_shape)

    def call(self, inputs):
        if self.post_norm:
            normed = self.norm(inputs)
            return keras.ops.add(normed, self.dense(normed))
        return inputs + self.dense(self.norm(inputs))

    def get_config(self):
        return {**super().get_config(), "post_norm": self.post_norm}


def _norm_block_model(post_norm: bool, initializer=_SEEDED) -> keras.Model:
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((4,))
        block = _NormBlock(post_norm, initializer, name="block")(inputs)
        logits = keras.layers.Dense(2, name="logits", kernel_initializer=initializer)(block)
        model = keras.Model(inputs, logits, name="blocks")
    mpt_keras.PrecisionManifest(default="mixed_bfloat16").apply(model)
    return model


def test_a_norm_handing_back_to_a_post_norm_block_is_refused_a_pre_norm_one_served(tmp_path):
    # The float32 norm hands bfloat16 back to its block only with mpt_keras. Loaded without
    # it, the post-norm block adds the norm's float32 output: other outputs (with a raw `+`,
    # TensorFlow would not even load it back); the pre-norm block's Dense casts it anyway.
    post, pre = _norm_block_model(post_norm=True), _norm_block_model(post_norm=False)

    with pytest.raises(serving.NotServableError) as raised:
        serving.save_for_serving(post, tmp_path / "post.keras")
    serving.save_for_serving(pre, tmp_path / "pre.keras")

    assert str(raised.value) == (
        "Cannot save model 'blocks' for serving: its layers 'block/norm' hand their outputs "
        "back to their blocks in the blocks' dtype, which only mpt_keras does: without it the "
        "loaded model computes other outputs; serve the SavedModel of export_saved_model"
    )
    assert os.listdir(tmp_path) == ["pre.keras"]
    loaded = keras.saving.load_model(tmp_path / "pre.keras")
    inputs = np.random.default_rng(2).normal(size=(5, 4)).astype("float32")
    np.testing.assert_array_equal(loaded.predict(inputs, verbose=0), pre.predict(inputs, verbose=0))


@pytest.mark.parametrize("seed", [21, 26, 28])
def test_a_post_norm_hand_back_is_refused_where_one_probe_row_would_round_alike(seed, tmp_path):
    # Under these seeds, Keras' draws give weights for which one row computes the same with
    # and without the hand-back: the probe's batch of rows tells them apart.
    keras.utils.set_random_seed(seed)
    post = _norm_block_model(post_norm=True, initializer="glorot_uniform")

    with pytest.raises(serving.NotServableError):
        serving.save_for_serving(post, tmp_path / "post.keras")


@keras.saving.register_keras_serializable(package="tests")
class _NormInItsCall(keras.Model):
    """A subclassed model creating its norm and head float32 itself: loaded, each layer
    computes as trained, yet its norm hands bfloat16 back to it only with mpt_keras."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, name="hidden", dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization(name="norm", dtype="float32")
        self.logits = keras.layers.Dense(2, name="logits", dtype="float32")

    def call(self, inputs):
        hidden = self.hidden(inputs)
        return self.logits(hidden + self.norm(hidden))


def test_a_subclassed_model_whose_norm_hands_back_is_refused_as_unprobed(tmp_path):
    model = _NormInItsCall(dtype="mixed_bfloat16", name="subclassed")
    mpt_keras.PrecisionManifest(default="mixed_bfloat16").apply(model)
    model(np.zeros((1, 4), "float32"))  # Without mpt_keras, TensorFlow's `+` would raise.

    with pytest.raises(serving.NotServableError) as raised:
        serving.save_for_serving(model, tmp_path / "serving.keras")

    assert str(raised.value) == (
        "Cannot save model 'subclassed' for serving: its layers 'norm' hand their outputs "
        "back to their blocks in the blocks' dtype, which only mpt_keras does, and a "
        "subclassed model has no inputs to probe; serve the SavedModel of export_saved_model"
    )
    assert os.listdir(tmp_path) == []

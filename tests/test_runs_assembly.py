"""Tests of the run assembly: components from a config or the user's objects, data, precision."""

import logging
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.runs import assembly, precision_plan, resolution


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """A working directory holding the user's module `user_code` (factories below)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_code.py").write_text(
        textwrap.dedent(
            """
            import keras
            import numpy as np
            import tensorflow as tf

            def dense_model(input_shape, num_classes, units=4):
                inputs = keras.Input(input_shape)
                hidden = keras.layers.Dense(units, activation="relu")(inputs)
                return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(hidden))

            def blobs(examples=64, seed=0):
                rng = np.random.default_rng(seed)
                x = rng.normal(size=(examples, 3)).astype("float32")
                y = (x[:, 0] > 0).astype("int32")
                split = lambda a, b: tf.data.Dataset.from_tensor_slices((x[a:b], y[a:b]))
                return split(0, examples - 16), split(examples - 16, examples), {"num_classes": 2}

            def weighted_blobs():
                x = np.arange(12, dtype="float32").reshape(4, 3)
                elements = (x, np.zeros(4, "int32"), np.ones(4, "float32"))
                dataset = tf.data.Dataset.from_tensor_slices(elements)
                return dataset, dataset

            def not_data():
                return [1, 2]

            def batched_blobs(how="batch"):
                train, evaluation, dimensions = blobs()
                batch = {
                    "batch": lambda d: d.batch(16),
                    "drop_remainder": lambda d: d.batch(16, drop_remainder=True).prefetch(2),
                    "padded": lambda d: d.padded_batch(16).map(lambda x, y: (x, y)),
                    "zipped": lambda d: tf.data.Dataset.zip(
                        (d.map(lambda x, y: x).batch(16), d.map(lambda x, y: y).batch(16))
                    ),
                    "unbatched_again": lambda d: d.batch(16).unbatch(),
                    "sequences": lambda d: d.map(lambda x, y: (tf.tile(x, [y + 1]), y)),
                }[how]
                return batch(train), batch(evaluation), dimensions

            def odd_dimensions():
                train, evaluation, _ = blobs()
                return train, evaluation, {"classes": 2}

            def no_model(input_shape, num_classes):
                return "a model"

            def failing_model(input_shape, num_classes):
                raise ValueError("width must be even")

            def broken_data():
                raise RuntimeError("the disk is gone")

            def two_heads(input_shape, num_classes):
                # A backbone of its own under two heads: a nested functional model.
                inputs = keras.Input(input_shape)
                features = keras.layers.Dense(4, activation="relu", name="features")(inputs)
                backbone = keras.Model(inputs, features, name="backbone")
                outer = keras.Input(input_shape, name="x")
                hidden = backbone(outer)
                logits = keras.layers.Dense(num_classes, name="digit")(hidden)
                return keras.Model(outer, {"digit": logits, "sign": keras.layers.Dense(2)(hidden)})

            def two_label_blobs():
                train, evaluation, dimensions = blobs()
                both = lambda d: d.map(lambda x, y: (x, {"digit": y, "sign": 1 - y}))
                return both(train), both(evaluation), dimensions

            def loss_per_head():
                loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                return {"digit": loss, "sign": "sparse_categorical_crossentropy"}

            def squared_error(y_true, y_pred):
                return keras.ops.mean((keras.ops.cast(y_true, "float32") - y_pred) ** 2)

            class Scale(keras.layers.Layer):
                # A float32 NumPy constant times a bfloat16 input is float32.
                def call(self, inputs):
                    return keras.ops.multiply(inputs, np.full((4,), 2.0, "float32"))

            def scaling_model(input_shape, num_classes):
                inputs = keras.Input(input_shape)
                hidden = keras.layers.Dense(4, name="hidden")(inputs)
                logits = keras.layers.Dense(num_classes, name="logits")(Scale(name="scale")(hidden))
                return keras.Model(inputs, logits)

            class ScalingModel(keras.Model):
                def __init__(self, num_classes):
                    super().__init__(name="scaling_model")
                    self.hidden = keras.layers.Dense(4, name="hidden")
                    self.scale = Scale(name="scale")
                    self.logits = keras.layers.Dense(num_classes, name="logits")

                def call(self, inputs):
                    return self.logits(self.scale(self.hidden(inputs)))
            """
        )
    )
    yield tmp_path
    sys.modules.pop("user_code", None)


def _config(**values) -> TrainConfig:
    return TrainConfig.from_dict(values)


def _blobs_config(**values) -> TrainConfig:
    return _config(
        model={"factory": "user_code:dense_model", "options": {"units": 3}},
        data={"factory": "user_code:blobs", "options": {"examples": 48}, "batch_size": 8},
        loss={"name": "sparse_categorical_crossentropy", "options": {"from_logits": True}},
        metrics=["accuracy"],
        **values,
    )


def test_a_config_of_factories_assembles_and_trains(user_code):
    config = _blobs_config(steps=3)
    components = resolution.resolve_components(config)
    data = components.data()
    assert data.dimensions == {"input_shape": (3,), "num_classes": 2}
    run = assembly.assemble(config, components, data)
    assert [layer.name for layer in run.model.layers] == ["input_layer", "dense", "logits"]
    assert run.model.layers[1].units == 3
    history = run.model.fit(data.train_batches(8, seed=0), epochs=1, steps_per_epoch=3, verbose=0)
    assert sorted(history.history) == [
        "accuracy",
        "bad_batches",
        "gradient_norm",
        "loss",
        "loss_scale",
        "skipped_steps",
    ]
    assert int(run.optimizer.iterations.numpy()) == 3


def test_dataset_batches_are_seeded_and_resume_at_the_exact_step(user_code):
    data = resolution.resolve_components(_blobs_config()).data()

    def batches(start_step, count):
        stream = data.train_batches(8, seed=5, start_step=start_step, shuffle_buffer=100)
        return [x.numpy() for x, _ in stream.take(count)]

    # 32 train examples: 4 batches a pass, so steps 3..6 straddle a reshuffle.
    from_start = batches(0, 7)
    resumed = batches(3, 4)
    for expected, received in zip(from_start[3:], resumed):
        np.testing.assert_array_equal(expected, received)
    assert not np.array_equal(np.sort(from_start[0], 0), np.sort(from_start[4], 0))


def test_sample_weights_of_a_data_factory_reach_the_batches(user_code):
    config = _config(
        model={"factory": "user_code:dense_model"},
        data={"factory": "user_code:weighted_blobs", "batch_size": 2},
        loss="mse",
    )
    data = resolution.resolve_components(config).data()
    x, y, weights = next(iter(data.train_batches(2, seed=0)))
    assert (x.shape, y.shape, weights.numpy().tolist()) == ((2, 3), (2,), [1.0, 1.0])


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"data": {"factory": "user_code:not_data"}},
            "data.factory user_code:not_data returned list. Allowed: (train, eval), each an "
            "unbatched tf.data.Dataset or (x, y[, sample_weight]) arrays, optionally with a "
            "third element, a dict of dimensions such as {'num_classes': 10}",
        ),
        (
            {"data": {"factory": "user_code:odd_dimensions"}},
            "data.factory user_code:odd_dimensions: its dimensions {'classes': 2} are not a dict "
            "of known names. Allowed: a dict with keys among input_shape, num_classes, "
            "vocab_size, sequence_length",
        ),
        (
            {"loss": "sparse_categorical_crossentropi"},
            "key 'loss.name': unknown loss 'sparse_categorical_crossentropi'. Allowed: a name of "
            "keras.losses (such as sparse_categorical_crossentropy) or a factory",
        ),
        (
            {"loss": {"name": "sparse_categorical_crossentropy", "options": {"logits": True}}},
            "unknown option 'loss.options.logits' for keras.losses.SparseCategoricalCrossentropy. "
            "Allowed: from_logits, ignore_class, reduction, axis, name, dtype",
        ),
        (
            {"metrics": ["acurracy"]},
            "key 'metrics[0].name': unknown metric 'acurracy'. Allowed: a name of keras.metrics "
            "(such as accuracy) or a factory",
        ),
        (
            {"metrics": [{"name": "top_k", "options": {"k": 2}}]},
            "key 'metrics[0].name': 'top_k' with options needs a class of keras.metrics; there is "
            "no keras.metrics.TopK. Allowed: a class name such as SparseCategoricalAccuracy",
        ),
    ],
)
def test_bad_components_are_one_line_errors_before_anything_is_built(user_code, values, message):
    config = _blobs_config().merged(values)
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config).data()
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "how, shapes",
    [
        ("batch", "(None, 3), (None,)"),
        ("drop_remainder", "(16, 3), (16,)"),
        ("padded", "(None, 3), (None,)"),
        ("zipped", "(None, 3), (None,)"),
    ],
)
def test_a_data_factory_that_batches_is_one_line_naming_the_runs_batch_size(user_code, how, shapes):
    config = _blobs_config().merged(
        {"data": {"factory": "user_code:batched_blobs", "options": {"how": how}, "batch_size": 8}}
    )
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config).data()
    assert str(raised.value) == (
        "data.factory user_code:batched_blobs: train: received a batched tf.data.Dataset (a "
        f".batch() in its pipeline; elements of shapes {shapes}), but the run batches the data "
        "itself (data.batch_size: 8). Allowed: unbatched (x, y) or (x, y, sample_weight) "
        "elements: leave out the .batch() (or add .unbatch())"
    )


@pytest.mark.parametrize("how", ["unbatched_again", "sequences"])
def test_unbatched_data_is_taken_even_when_its_shapes_look_batched(user_code, how):
    """An .unbatch() after the .batch(), and sequences of unknown length (a leading None)."""
    config = _blobs_config().merged(
        {"data": {"factory": "user_code:batched_blobs", "options": {"how": how}}}
    )
    data = resolution.resolve_components(config).data()
    assert isinstance(data.train, tf.data.Dataset)


def test_batched_data_given_to_validate_names_the_configs_batch_size():
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((8, 3), "float32"), np.zeros(8)))
    with pytest.raises(UserInputError) as raised:
        resolution.resolve(lambda: None, data=(dataset.batch(4), dataset), loss="mse")
    assert str(raised.value) == (
        "data[0]: received a batched tf.data.Dataset (a .batch() in its pipeline; elements of "
        "shapes (None, 3), (None,)), but the run batches the data itself "
        "(config.data.batch_size: 64). Allowed: unbatched (x, y) or (x, y, sample_weight) "
        "elements: leave out the .batch() (or add .unbatch())"
    )


def test_a_data_factory_that_fails_is_reported_with_its_file_and_line(user_code):
    config = _blobs_config().merged({"data": {"factory": "user_code:broken_data"}})
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config).data()
    source = (user_code / "user_code.py").read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(source) if "the disk is gone" in text)
    assert str(raised.value) == (
        "data.factory user_code:broken_data failed: RuntimeError: the disk is gone "
        f"({user_code / 'user_code.py'}, line {line})"
    )


@pytest.mark.parametrize(
    "factory, message",
    [
        ("user_code:no_model", "the model factory returned str. Allowed: a keras.Model"),
        ("user_code:failing_model", "the model factory failed: ValueError: width must be even"),
    ],
)
def test_a_model_factory_that_fails_or_returns_no_model_is_one_line(user_code, factory, message):
    config = _blobs_config().merged({"model": {"factory": factory, "options": {}}})
    components = resolution.resolve_components(config)
    with pytest.raises(UserInputError) as raised:
        precision_plan.build_model(config, components, components.data())
    assert str(raised.value).startswith(message)


def test_a_model_file_that_is_no_keras_archive_is_one_line(user_code, tmp_path):
    (tmp_path / "notes.keras").write_text("not a zip")
    config = _config(model={"file": str(tmp_path / "notes.keras")})
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config)
    assert str(raised.value) == (
        f"model.file {tmp_path / 'notes.keras'}: not a Keras archive (File is not a zip file). "
        "Allowed: a .keras file saved by model.save"
    )


def test_a_loss_from_the_users_code_is_used_as_given(user_code):
    components = resolution.resolve_components(
        _blobs_config().merged({"loss": {"factory": "user_code:squared_error"}})
    )
    assert components.loss.__name__ == "squared_error"


def test_a_loss_factory_of_no_arguments_is_called_each_metric_goes_to_each_output(user_code):
    config = _blobs_config(steps=2).merged(
        {
            "model": {"factory": "user_code:two_heads", "options": {}},
            "data": {"factory": "user_code:two_label_blobs"},
            "loss": {"factory": "user_code:loss_per_head"},
        }
    )
    components = resolution.resolve_components(config)
    assert sorted(components.loss) == ["digit", "sign"]
    data = components.data()
    run = assembly.assemble(config, components, data)
    history = run.model.fit(data.train_batches(8, seed=0), epochs=1, steps_per_epoch=2, verbose=0)
    assert sorted(name for name in history.history if "_" in name and "step" not in name) == [
        "bad_batches",
        "digit_accuracy",
        "digit_loss",
        "gradient_norm",
        "loss_scale",
        "sign_accuracy",
        "sign_loss",
    ]


class _TwoHeads(keras.Model):
    """Subclassed: its outputs are known only once called, so its metrics follow its labels."""

    def __init__(self):
        super().__init__(name="two_heads")
        self.a, self.b = keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")

    def call(self, inputs):
        return {"a": self.a(inputs), "b": self.b(inputs)}


def test_a_subclassed_model_of_several_outputs_gets_each_metric_on_each_of_its_labels():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = {"a": np.arange(16) % 3, "b": np.arange(16) % 2}
    config, components = resolution.resolve(
        _TwoHeads,
        data=((x, y), (x, y)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        config=TrainConfig.from_dict({"data": {"batch_size": 8}}),
    )
    data = components.data()
    run = assembly.assemble(config, components, data)
    logs = run.model.evaluate(data.eval_batches(8), return_dict=True, verbose=0)
    assert sorted(logs) == ["a_accuracy", "a_loss", "b_accuracy", "b_loss", "loss"]


def test_a_model_file_brings_its_weights_and_compiled_loss(user_code, tmp_path):
    inputs = keras.Input((3,))
    saved = keras.Model(inputs, keras.layers.Dense(2, name="logits")(inputs))
    saved.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    path = str(tmp_path / "mine.keras")
    saved.save(path)
    config = _config(model={"file": path}, data={"factory": "user_code:blobs", "batch_size": 8})
    components = resolution.resolve_components(config)
    assert isinstance(components.loss, keras.losses.SparseCategoricalCrossentropy)
    assert components.loss.get_config()["from_logits"] is True
    assert [make() for make in components.metrics] == ["accuracy"]
    model, _, report = precision_plan.build_model(config, components, components.data())
    np.testing.assert_array_equal(model.get_weights()[0], saved.get_weights()[0])
    assert report.precision == "float32"


def test_a_model_file_without_a_loss_needs_one_in_the_config(user_code, tmp_path):
    inputs = keras.Input((3,))
    keras.Model(inputs, keras.layers.Dense(2)(inputs)).save(str(tmp_path / "bare.keras"))
    config = _config(model={"file": str(tmp_path / "bare.keras")})
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config)
    assert str(raised.value) == (
        f"model.file {tmp_path / 'bare.keras'} was saved without a compiled loss. "
        "Allowed: name one with the config key 'loss'"
    )


def test_the_users_own_objects_need_data_and_loss():
    with pytest.raises(UserInputError) as raised:
        resolution.resolve(lambda: None, data=None, loss="mse")
    assert str(raised.value) == (
        "data: required with a model of your own. Allowed: data=(train, eval) and loss=a Keras loss"
    )


def test_arrays_given_as_data_rather_than_splits_are_one_line():
    # calibrate takes data=(x, y); validate, run_canary and train_with_canary take splits.
    x, y = np.zeros((4, 3), "float32"), np.zeros(4, "int32")
    with pytest.raises(UserInputError) as raised:
        resolution.resolve(lambda: None, data=(x, y), loss="mse")
    assert str(raised.value) == (
        "data: received (ndarray, ndarray), arrays (x, y) rather than splits. Allowed: a tuple "
        "(train, eval) of tf.data.Datasets or of (x, y) or (x, y, sample_weight) array tuples: "
        "data=((x, y), (x_eval, y_eval))"
    )


def test_a_functional_model_of_ones_own_is_cloned_with_its_weights():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    arrays = (np.zeros((4, 3), "float32"), np.zeros(4, "int32"))
    config, components = resolution.resolve(model, data=(arrays, arrays), loss="mse")
    clone = components.model()
    assert clone is not model
    np.testing.assert_array_equal(clone.get_weights()[0], model.get_weights()[0])
    assert config == TrainConfig()


def test_a_tfds_dataset_of_any_shape_is_read_through_a_feature_mapping(tfds_dir):
    config = _config(
        model={"name": "mlp"},
        data={
            "name": "mpt_digits",
            "data_dir": tfds_dir,
            "features": {"x": {"pixels": "image"}, "y": "label"},
        },
    )
    data = resolution.resolve_components(config).data()
    assert data.dimensions == {"num_classes": 10}  # A dict x: no single input shape.
    x, y = next(iter(data.train_batches(4, seed=0)))
    assert (sorted(x), x["pixels"].dtype, x["pixels"].shape, y.shape) == (
        ["pixels"],
        tf.uint8,
        (4, 8, 8, 1),
        (4,),
    )


def test_a_feature_mapping_naming_a_missing_feature_is_one_line(tfds_dir):
    config = _config(
        data={"name": "mpt_digits", "data_dir": tfds_dir, "features": {"x": "img", "y": "label"}}
    )
    with pytest.raises(UserInputError) as raised:
        resolution.resolve_components(config).data()
    assert str(raised.value) == (
        "data.features: dataset 'mpt_digits' has no feature 'img'. "
        "Allowed: image (Image), label (ClassLabel)"
    )


def test_each_model_gets_its_own_metrics(user_code):
    config = _blobs_config().merged(
        {"metrics": ["accuracy", "auc", {"name": "AUC", "options": {"num_thresholds": 10}}]}
    )
    components = resolution.resolve_components(config)
    first, second = ([make() for make in components.metrics] for _ in range(2))
    assert first[:2] == second[:2] == ["accuracy", "auc"]
    assert first[2].num_thresholds == 10 and first[2] is not second[2]


def test_resolving_a_config_starts_no_tensorflow_runtime(user_code):
    # The run's strategy (virtual CPUs, workers) must come before TensorFlow's runtime,
    # so a fresh process tells: this one's runtime runs already.
    script = textwrap.dedent(
        """
        from tensorflow.python.eager import context
        from mpt_keras.runs import resolution
        from mpt_keras.config import TrainConfig

        config = TrainConfig.from_dict({
            "model": {"factory": "user_code:dense_model"},
            "data": {"factory": "user_code:blobs"},
            "loss": {"name": "sparse_categorical_crossentropy", "options": {"from_logits": True}},
            "metrics": ["accuracy", {"name": "AUC", "options": {"num_thresholds": 10}}],
        })
        resolution.resolve_components(config)
        print(context.context()._context_handle is None)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=user_code, capture_output=True, text=True, timeout=300
    )
    assert result.stdout == "True\n", result.stderr


def test_the_example_manifest_keeps_the_gpt2_softmax_float32(tfds_dir, monkeypatch):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(repo)
    config = TrainConfig.from_json(os.path.join(repo, "examples/configs/gpt2_python_source.json"))
    config = config.merged(
        {
            "manifest": os.path.join(repo, "examples/manifests/gpt2_float16.json"),
            "data": {"data_dir": tfds_dir, "options": {"sequence_length": 8}},
        }
    )
    layers = {layer.path: layer for layer in assembly.plan_precision(config).layers}
    softmaxes = [path for path in layers if path.endswith("/_softmax")]
    assert softmaxes == [
        "gpt2_backbone/transformer_layer_0/self_attention/_softmax",
        "gpt2_backbone/transformer_layer_1/self_attention/_softmax",
    ]
    assert {layers[path].compute_dtype for path in softmaxes} == {"float32"}
    query = layers["gpt2_backbone/transformer_layer_0/self_attention/query"]
    assert query.compute_dtype == "float16"


@pytest.mark.parametrize(
    "factory",
    ["user_code:scaling_model", "user_code:ScalingModel"],
    ids=["functional", "subclassed"],
)
def test_a_layer_outputting_another_dtype_is_marked_in_the_table_and_warned(
    user_code, factory, caplog
):
    # A subclassed model has no inputs of its own: it is traced on an example.
    config = _blobs_config(precision="mixed_bfloat16").merged({"model": {"factory": factory}})
    with caplog.at_level(logging.WARNING, logger="mpt_keras.runs.precision_plan"):
        report = assembly.plan_precision(config)
    assert [(layer.path, layer.output_dtype) for layer in report.layers] == [
        ("hidden", "bfloat16"),
        ("scale", "float32"),
        ("logits", "float32"),
    ]
    assert report.output_dtype_mismatches == ("scale",)
    assert report.format_table() == (
        "path    class  policy          decided_by\n"
        "hidden  Dense  mixed_bfloat16  default\n"
        "scale   Scale  mixed_bfloat16  default                     "
        "<- outputs float32, computes in bfloat16\n"
        "logits  Dense  float32         safe default: model output\n"
    )
    assert caplog.messages == [
        "Layer scale (Scale) computes in bfloat16 but outputs float32: an op in its call "
        "mixes in a float32 value (a NumPy array, a variable) or casts to it; cast to "
        "self.compute_dtype if that is not meant."
    ]


def test_a_run_without_such_layers_marks_and_warns_nothing(user_code, caplog):
    with caplog.at_level(logging.WARNING, logger="mpt_keras.runs.precision_plan"):
        report = assembly.plan_precision(_blobs_config(precision="mixed_float16"))
    assert [(layer.path, layer.compute_dtype, layer.output_dtype) for layer in report.layers] == [
        ("dense", "float16", "float16"),
        ("logits", "float32", "float32"),
    ]
    assert report.output_dtype_mismatches == ()
    assert "<-" not in report.format_table()
    assert caplog.messages == []

"""Tests of mpt_keras.config: strict parsing, layered overrides, messages."""

import json

import pytest

from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import UserInputError
from mpt_keras.files import parse_json_object
from mpt_keras.scaling.settings import LossScaleSettings


def _write(tmp_path, value, name="run.json"):
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_defaults_round_trip_through_json():
    config = TrainConfig()
    assert TrainConfig.from_dict(json.loads(config.to_json())) == config


def test_to_json_writes_the_file_from_json_reads(tmp_path):
    config = TrainConfig().merged({"steps": 7})
    text = config.to_json(tmp_path / "run.json")
    assert (tmp_path / "run.json").read_text() == text == config.to_json()
    assert TrainConfig.from_json(tmp_path / "run.json") == config


def test_file_values_override_defaults(tmp_path):
    path = _write(tmp_path, {"steps": 7, "data": {"batch_size": 16}})
    config = TrainConfig.from_json(path)
    assert (config.steps, config.data.batch_size, config.data.name) == (7, 16, "mpt_digits")


def test_layers_apply_in_order_file_override_flags(tmp_path):
    path = _write(tmp_path, {"steps": 7, "precision": "float32", "data": {"batch_size": 16}})
    config = resolve_config(
        path,
        '{"steps": 8, "data": {"eval_batch_size": 32}}',
        steps=9,
        precision=None,
    )
    assert config.steps == 9  # The flag beats the override, which beat the file.
    assert config.precision == "float32"  # A None flag leaves the file's value.
    assert (config.data.batch_size, config.data.eval_batch_size) == (16, 32)


def test_model_options_merge_key_by_key(tmp_path):
    path = _write(
        tmp_path, {"model": {"name": "mlp", "options": {"hidden_units": [8], "dropout": 0.5}}}
    )
    config = resolve_config(path, '{"model": {"options": {"dropout": 0.0}}}')
    assert config.model.options == {"hidden_units": [8], "dropout": 0.0}


def test_integers_are_accepted_for_floats():
    assert TrainConfig.from_dict({"optimizer": {"learning_rate": 1}}).optimizer.learning_rate == 1.0


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"stpes": 3},
            "unknown key 'stpes'. Allowed keys: precision, manifest, seed, steps, "
            "checkpoint_every, eval_every, keep_checkpoints, log_every, strategy, virtual_cpus, "
            "tpu, jit_compile, auto_promote, deterministic, saved_model, imports, data, model, "
            "loss, metrics, optimizer, loss_scale, divergence",
        ),
        (
            {"data": {"batch": 3}},
            "unknown key 'data.batch'. Allowed keys in data: name, factory, options, features, "
            "shuffle_buffer, data_dir, train_split, eval_split, batch_size, eval_batch_size, "
            "sequence_length, eval_examples, max_bad_batches",
        ),
        ({"steps": "10"}, "key 'steps': received \"10\". Allowed: an integer"),
        ({"steps": True}, "key 'steps': received true. Allowed: an integer"),
        ({"steps": 0}, "key 'steps': received 0. Allowed: an integer >= 1"),
        (
            {"precision": "fp16"},
            "key 'precision': received \"fp16\". Allowed: float32, mixed_float16, "
            "mixed_bfloat16, auto",
        ),
        (
            {"eval_every": 150},
            "key 'eval_every': received 150. Allowed: a positive multiple of checkpoint_every "
            "(100)",
        ),
        ({"data": [1]}, "key 'data': received [1]. Allowed: a JSON object"),
        (
            {"optimizer": {"name": "adam", "weight_decay": 0.1}},
            "key 'optimizer.weight_decay': received 0.1. Allowed: 0 unless optimizer.name is "
            "'adamw'",
        ),
        (
            {"optimizer": {"global_clipnorm": -1}},
            "key 'optimizer.global_clipnorm': received -1.0. Allowed: null or a number > 0",
        ),
        (
            {"divergence": {"lr_factor": 1}},
            "key 'divergence.lr_factor': received 1.0. Allowed: a number > 0 and < 1",
        ),
        # Found by tests/test_fuzz.py:
        ({"seed": -1}, "key 'seed': received -1. Allowed: an integer in [0, 4294967295]"),
        (
            {"seed": 2**32},
            "key 'seed': received 4294967296. Allowed: an integer in [0, 4294967295]",
        ),
        (
            {"optimizer": {"learning_rate": float("inf")}},
            "key 'optimizer.learning_rate': received Infinity. Allowed: a finite number",
        ),
        (
            {"loss_scale": {"initial_scale": float("nan")}},
            "key 'loss_scale.initial_scale': received NaN. Allowed: a finite number",
        ),
        # Checked as LossScaleSettings when read, before a model is built, naming the key.
        (
            {"loss_scale": {"growth_factor": 0.5}},
            "key 'loss_scale.growth_factor': received 0.5. Allowed: a number > 1 and "
            "<= 3.40282e+38",
        ),
        (
            {"loss_scale": {"min_scale": 4.0, "initial_scale": 2.0}},
            "key 'loss_scale.initial_scale': received 2.0. Allowed: a number in "
            "[min_scale, max_scale] = [4.0, 16777216.0]",
        ),
        (
            {"loss_scale": {"min_scale": 4.0, "max_scale": 2.0}},
            "key 'loss_scale.max_scale': received 2.0. Allowed: a number >= min_scale (4.0)",
        ),
        (
            {"loss_scale": {"growth_interval": 0}},
            "key 'loss_scale.growth_interval': received 0. Allowed: an integer >= 1",
        ),
        # The run decides these settings (the scale is dynamic only with float16 layers).
        (
            {"loss_scale": {"dynamic": False}},
            "unknown key 'loss_scale.dynamic'. Allowed keys in loss_scale: initial_scale, "
            "growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale",
        ),
        (
            {"optimizer": {"learning_rate": 10**309}},
            "key 'optimizer.learning_rate': received 1" + "0" * 309 + ". Allowed: a finite number",
        ),
        (
            {"a\nb": 1},
            "unknown key 'a\\nb'. Allowed keys: precision, manifest, seed, steps, "
            "checkpoint_every, eval_every, keep_checkpoints, log_every, strategy, virtual_cpus, "
            "tpu, jit_compile, auto_promote, deterministic, saved_model, imports, data, model, "
            "loss, metrics, optimizer, loss_scale, divergence",
        ),
    ],
)
def test_bad_values_name_the_file_key_and_what_is_allowed(tmp_path, values, message):
    path = _write(tmp_path, values)
    with pytest.raises(UserInputError) as raised:
        TrainConfig.from_json(path)
    assert str(raised.value) == f"{path}: {message}"


def test_missing_file(tmp_path):
    with pytest.raises(UserInputError, match=r"^/\S+/absent.json: no such file$"):
        TrainConfig.from_json(tmp_path / "absent.json")


def test_malformed_json_names_file_and_position(tmp_path):
    path = _write(tmp_path, '{\n  "steps": 3,\n}')
    with pytest.raises(UserInputError) as raised:
        TrainConfig.from_json(path)
    assert str(raised.value) == (
        f"{path}: malformed JSON at line 3 column 1: "
        "Expecting property name enclosed in double quotes"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[" * 5000 + "]" * 5000,
            "JSON arrays and objects nested too deeply for Python's recursion limit",
        ),
        (
            '{"steps": ' + "9" * 5000 + "}",
            "a JSON integer is too long. Allowed: at most 4300 digits",
        ),
    ],
)
def test_json_python_cannot_read_is_a_user_error(text, message):
    # Found by tests/test_fuzz.py: RecursionError and ValueError escaped.
    with pytest.raises(UserInputError) as raised:
        parse_json_object(text, "--config_override")
    assert str(raised.value).startswith(f"--config_override: {message}")


def test_json_that_is_not_an_object():
    with pytest.raises(UserInputError) as raised:
        parse_json_object("[1, 2]", "--config_override")
    assert str(raised.value) == "--config_override: expected a JSON object, received list"


def test_flag_errors_name_the_flag(tmp_path):
    with pytest.raises(UserInputError) as raised:
        resolve_config(_write(tmp_path, {}), None, virtual_cpus=-1)
    assert (
        str(raised.value)
        == "--virtual_cpus: key 'virtual_cpus': received -1. Allowed: an integer >= 0"
    )


def test_override_errors_name_the_override(tmp_path):
    with pytest.raises(UserInputError) as raised:
        resolve_config(_write(tmp_path, {}), '{"data": {"batch_size": 0}}')
    assert str(raised.value) == (
        "--config_override: key 'data.batch_size': received 0. Allowed: an integer >= 1"
    )


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        TrainConfig().steps = 3


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"model": {"factory": "my_models.build"}},
            "key 'model.factory': received \"my_models.build\". "
            "Allowed: 'package.module:attribute'",
        ),
        (
            {"model": {"name": "cnn", "file": "model.keras"}},
            "model: the source: received 'name' and 'file'. Allowed: exactly one of 'name', "
            "'factory', 'file'",
        ),
        (
            {"model": {"name": "resnet"}},
            "key 'model.name': received \"resnet\". Allowed: mlp, cnn, transformer_lm",
        ),
        (
            {"model": {"file": "model.h5"}},
            "key 'model.file': received \"model.h5\". Allowed: the path of a .keras file",
        ),
        (
            {"model": {"file": "model.keras", "options": {"a": 1}}},
            "key 'model.options': received {\"a\": 1}. Allowed: empty for model.file",
        ),
        (
            {"model": {"factory": "my_models:build"}},
            "key 'loss': received null. Allowed: a loss (a Keras name or a factory) when the "
            "model comes from model.factory",
        ),
        (
            {"data": {"name": "mnist", "factory": "my_data:load"}},
            "data: the source: received 'name' and 'factory'. Allowed: exactly one of 'name', "
            "'factory'",
        ),
        (
            {"data": {"name": "mnist", "options": {"a": 1}}},
            "key 'data.options': received {\"a\": 1}. Allowed: empty unless data.factory is "
            "given (TFDS datasets take no options)",
        ),
        (
            {"data": {"factory": "my_data:load", "features": {"x": "image", "y": "label"}}},
            'key \'data.features\': received {"x": "image", "y": "label"}. Allowed: null, or '
            'with data.name an object {"x": FEATURE or {INPUT: FEATURE, ...}, "y": FEATURE}',
        ),
        (
            {"data": {"shuffle_buffer": 0}},
            "key 'data.shuffle_buffer': received 0. Allowed: an integer >= 1",
        ),
        (
            {"loss": {"name": "mse", "factory": "my_losses:huber"}},
            "loss: the source: received 'name' and 'factory'. Allowed: exactly one of 'name', "
            "'factory'",
        ),
        (
            {"metrics": "accuracy"},
            "key 'metrics': received \"accuracy\". Allowed: a JSON array or null",
        ),
        (
            {"metrics": [{}]},
            "metrics[0]: the source: received none. Allowed: exactly one of 'name', 'factory'",
        ),
        (
            {"metrics": [{"factory": "auc"}]},
            "metrics[0]: key 'factory': received \"auc\". Allowed: 'package.module:attribute'",
        ),
        (
            {"imports": ["my project"]},
            "key 'imports[0]': received \"my project\". Allowed: a dotted module name such as "
            "'my_project.layers'",
        ),
    ],
)
def test_bad_component_sources_name_the_key_and_what_is_allowed(tmp_path, values, message):
    path = _write(tmp_path, values)
    with pytest.raises(UserInputError) as raised:
        TrainConfig.from_json(path)
    assert str(raised.value) == f"{path}: {message}"


def test_components_round_trip_and_a_new_source_replaces_the_old_one():
    config = TrainConfig.from_dict(
        {
            "imports": ["my_project.layers"],
            "model": {"factory": "my_models:build", "options": {"width": 4}},
            "data": {"factory": "my_data:load", "options": {"size": 8}},
            "loss": "mse",
            "metrics": ["accuracy", {"name": "AUC", "options": {"num_thresholds": 10}}],
        }
    )
    assert TrainConfig.from_dict(json.loads(config.to_json())) == config
    assert (config.loss.name, [metric.name for metric in config.metrics]) == (
        "mse",
        ["accuracy", "AUC"],
    )
    merged = config.merged({"model": {"name": "mlp"}, "data": {"name": "mpt_digits"}})
    assert (merged.model.name, merged.model.factory, merged.model.options) == ("mlp", None, {})
    assert (merged.data.name, merged.data.factory, merged.data.options) == ("mpt_digits", None, {})
    # Without a source, the defaults: the cnn on the embedded digits.
    assert (TrainConfig().model.name, TrainConfig().data.name) == ("cnn", "mpt_digits")


def test_a_missing_model_file_is_named_before_anything_runs(tmp_path):
    path = _write(tmp_path, {"model": {"file": str(tmp_path / "gone.keras")}})
    with pytest.raises(UserInputError) as raised:
        resolve_config(path)
    assert (
        str(raised.value) == f"{path}: key 'model.file': no such file '{tmp_path / 'gone.keras'}'"
    )


@pytest.mark.parametrize(
    "override, flags, source",
    [
        (None, {"manifest": "missing.json"}, "--manifest"),
        ('{"manifest": "missing.json"}', {}, "--config_override"),
        # The last layer that set it is named.
        ('{"manifest": "other.json"}', {"manifest": "missing.json"}, "--manifest"),
    ],
)
def test_a_missing_file_is_named_by_the_layer_that_set_it(
    tmp_path, monkeypatch, override, flags, source
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as raised:
        resolve_config(_write(tmp_path, {}), override, **flags)
    assert str(raised.value) == f"{source}: key 'manifest': no such file 'missing.json'"


def test_the_loss_scale_section_is_the_loss_scale_settings():
    config = TrainConfig.from_dict({"loss_scale": {"growth_interval": 7}})
    assert config.loss_scale == LossScaleSettings(growth_interval=7)
    # The run decides `dynamic` and `all_reduce_dtype`: they are no config keys.
    assert sorted(config.to_dict()["loss_scale"]) == [
        "backoff_factor",
        "growth_factor",
        "growth_interval",
        "hysteresis",
        "initial_scale",
        "max_scale",
        "min_scale",
    ]

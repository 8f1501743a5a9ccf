"""Tests of mpt_keras.config: strict parsing, layered overrides, messages."""

import json

import pytest

from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import UserInputError
from mpt_keras.files import parse_json_object


def _write(tmp_path, value, name="run.json"):
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_defaults_round_trip_through_json():
    config = TrainConfig()
    assert TrainConfig.from_dict(json.loads(config.to_json())) == config


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
            "tpu, jit_compile, auto_promote, deterministic, imports, data, model, loss, metrics, "
            "optimizer, loss_scale, "
            "divergence",
        ),
        (
            {"data": {"batch": 3}},
            "unknown key 'data.batch'. Allowed keys in data: name, factory, options, features, "
            "shuffle_buffer, data_dir, train_split, eval_split, batch_size, eval_batch_size, "
            "sequence_length, eval_examples, max_bad_batches",
        ),
        ({"steps": "10"}, "key 'steps' must be an integer, received \"10\""),
        ({"steps": True}, "key 'steps' must be an integer, received true"),
        ({"steps": 0}, "key 'steps' must be an integer >= 1, received 0"),
        (
            {"precision": "fp16"},
            "key 'precision' must be one of float32, mixed_float16, mixed_bfloat16, "
            'auto; received "fp16"',
        ),
        (
            {"eval_every": 150},
            "key 'eval_every' must be a positive multiple of checkpoint_every (100), received 150",
        ),
        ({"data": [1]}, "data must be a JSON object, received [1]"),
        (
            {"optimizer": {"name": "adam", "weight_decay": 0.1}},
            "key 'optimizer.weight_decay' must be 0 unless optimizer.name is 'adamw', received 0.1",
        ),
        (
            {"optimizer": {"global_clipnorm": -1}},
            "key 'optimizer.global_clipnorm' must be null or a number > 0, received -1.0",
        ),
        # Found by tests/test_fuzz.py:
        ({"seed": -1}, "key 'seed' must be an integer in [0, 4294967295], received -1"),
        ({"seed": 2**32}, "key 'seed' must be an integer in [0, 4294967295], received 4294967296"),
        (
            {"optimizer": {"learning_rate": float("inf")}},
            "key 'optimizer.learning_rate' must be a finite number, received Infinity",
        ),
        (
            {"loss_scale": {"initial_scale": float("nan")}},
            "key 'loss_scale.initial_scale' must be a finite number, received NaN",
        ),
        # Checked as LossScaleSettings when read, before a model is built.
        (
            {"loss_scale": {"growth_factor": 0.5}},
            "config section loss_scale: Argument growth_factor must be a finite number > 1. "
            "Received: growth_factor=0.5",
        ),
        (
            {"loss_scale": {"min_scale": 4.0, "initial_scale": 2.0}},
            "config section loss_scale: Argument initial_scale must be in [min_scale, max_scale] "
            "= [4.0, 16777216.0]. Received: initial_scale=2.0",
        ),
        (
            {"optimizer": {"learning_rate": 10**309}},
            "key 'optimizer.learning_rate' must be a finite number, received 1" + "0" * 309,
        ),
        (
            {"a\nb": 1},
            "unknown key 'a\\nb'. Allowed keys: precision, manifest, seed, steps, "
            "checkpoint_every, eval_every, keep_checkpoints, log_every, strategy, virtual_cpus, "
            "tpu, jit_compile, auto_promote, deterministic, imports, data, model, loss, metrics, "
            "optimizer, loss_scale, "
            "divergence",
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
        == "--virtual_cpus: key 'virtual_cpus' must be an integer >= 0, received -1"
    )


def test_override_errors_name_the_override(tmp_path):
    with pytest.raises(UserInputError) as raised:
        resolve_config(_write(tmp_path, {}), '{"data": {"batch_size": 0}}')
    assert str(raised.value) == (
        "--config_override: key 'data.batch_size' must be an integer >= 1, received 0"
    )


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        TrainConfig().steps = 3


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"model": {"factory": "my_models.build"}},
            "key 'model.factory' must be 'package.module:attribute', received \"my_models.build\"",
        ),
        (
            {"model": {"name": "cnn", "file": "model.keras"}},
            "model: exactly one source is allowed: 'name', 'factory', 'file'; received 'name' "
            "and 'file'",
        ),
        (
            {"model": {"name": "resnet"}},
            "key 'model.name' must be one of mlp, cnn, transformer_lm; received \"resnet\"",
        ),
        (
            {"model": {"file": "model.h5"}},
            "key 'model.file' must be the path of a .keras file, received \"model.h5\"",
        ),
        (
            {"model": {"file": "model.keras", "options": {"a": 1}}},
            "key 'model.options' must be empty for model.file, received {\"a\": 1}",
        ),
        (
            {"model": {"factory": "my_models:build"}},
            "key 'loss' must be a loss (a Keras name or a factory) when the model comes from "
            "model.factory, received null",
        ),
        (
            {"data": {"name": "mnist", "factory": "my_data:load"}},
            "data: exactly one source is allowed: 'name', 'factory'; received 'name' and 'factory'",
        ),
        (
            {"data": {"name": "mnist", "options": {"a": 1}}},
            "key 'data.options' must be empty unless data.factory is given (TFDS datasets take "
            'no options), received {"a": 1}',
        ),
        (
            {"data": {"factory": "my_data:load", "features": {"x": "image", "y": "label"}}},
            "key 'data.features' must be null, or with data.name an object {\"x\": FEATURE or "
            '{INPUT: FEATURE, ...}, "y": FEATURE}, received {"x": "image", "y": "label"}',
        ),
        (
            {"data": {"shuffle_buffer": 0}},
            "key 'data.shuffle_buffer' must be an integer >= 1, received 0",
        ),
        (
            {"loss": {"name": "mse", "factory": "my_losses:huber"}},
            "loss: exactly one source is allowed: 'name', 'factory'; received 'name' and 'factory'",
        ),
        (
            {"metrics": "accuracy"},
            "key 'metrics' must be a JSON array or null, received \"accuracy\"",
        ),
        (
            {"metrics": [{}]},
            "metrics[0]: exactly one source is allowed: 'name', 'factory'; received none",
        ),
        (
            {"metrics": [{"factory": "auc"}]},
            "metrics[0]: key 'factory' must be 'package.module:attribute', received \"auc\"",
        ),
        (
            {"imports": ["my project"]},
            "key 'imports[0]' must be a dotted module name such as 'my_project.layers', "
            'received "my project"',
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

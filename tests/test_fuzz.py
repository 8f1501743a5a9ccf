"""Bad input, fuzzed: configs, manifests and launcher flags meet only documented errors.

Hypothesis mutates the bundled configs and manifests (wrong types, unknown keys,
out-of-range and non-finite numbers, missing and junk sections, bad regexes,
keys and values with line breaks) and generates launcher flags. The properties:
the library returns a value or raises `UserInputError` with a one-line
message, nothing else; a launcher exits with status 2 and exactly one line,
`<program>: error: ...`, never a traceback.

Examples are derandomized and no example database is kept, so CI sees the same
inputs on every run.
"""

import copy
import glob
import json
import math
import os
from unittest import mock

import keras
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from launchers import launch_in_process

from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import UserInputError
from mpt_keras.files import parse_json_object
from mpt_keras.precision.manifest import PrecisionManifest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(pattern):
    paths = sorted(glob.glob(os.path.join(REPO, pattern)))
    assert paths, pattern
    values = []
    for path in paths:
        with open(path) as file:
            values.append(json.load(file))
    return values


CONFIGS = _load("configs/*.json")
MANIFESTS = _load("configs/manifests/*.json")


def _fuzz_settings(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


# Values a user gets wrong: types, boundaries, non-finite and huge numbers,
# line breaks and other characters that `str.splitlines` breaks on.
_NASTY_NUMBERS = [0, -1, 1, 2, 0.5, -0.0, 1e-300, 1e308, 2**31, 2**32, 2**63, 10**400]
_NASTY_NUMBERS += [math.nan, math.inf, -math.inf]
_NASTY_TEXT = ["", " ", "a\nb", "x\r", "tab\there", "\u2028", "\x85", "\ud800", "é", "'", '"']
_NASTY_TEXT += ["float32", "mixed_float16", "adamw", "cosine", ".*", "(", "a{4294967296}"]
_KEYS = st.one_of(st.sampled_from(["", "stpes", "a\nb", "\u2029", "data", "rules"]), st.text())
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(_NASTY_NUMBERS),
    st.text(max_size=10),
    st.sampled_from(_NASTY_TEXT),
)
_JSON_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(_KEYS, children, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value, prefix=()):
    """Every key path into nested JSON objects and arrays."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        yield (*prefix, key)
        if isinstance(child, (dict, list)) and child:
            yield from _paths(child, (*prefix, key))


@st.composite
def _mutated(draw, bases, extra_paths=(), values=_JSON_VALUES):
    """One of `bases` with a few keys replaced, deleted or added."""
    document = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, 3))):
        paths = sorted(set(_paths(document)) | set(extra_paths), key=repr)
        if not paths:
            return draw(values)
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            if isinstance(parent, dict):
                parent = parent.setdefault(key, {})
            elif isinstance(parent, list) and isinstance(key, int) and key < len(parent):
                parent = parent[key]
            else:
                break
        if isinstance(parent, list):
            if not parent:
                continue
            key = min(path[-1], len(parent) - 1) if isinstance(path[-1], int) else 0
        elif isinstance(parent, dict):
            key = path[-1]
        else:
            continue
        action = draw(st.sampled_from(["set", "set", "delete", "add_key"]))
        if action == "set" or (action == "delete" and isinstance(parent, list)):
            parent[key] = draw(values)
        elif action == "delete":
            parent.pop(key, None)
        elif isinstance(parent, dict):
            parent[draw(_KEYS)] = draw(values)
    return document


_CONFIG_KEY_PATHS = [
    (section, key) if section else (key,)
    for section, keys in [
        ("", TrainConfig().to_dict()),
        *[
            (name, value)
            for name, value in TrainConfig().to_dict().items()
            if isinstance(value, dict)
        ],
    ]
    for key in keys
] + [("model", "options", name) for name in ("hidden_units", "dropout", "filters", "d_model")]
_CONFIGS = _mutated(
    [*CONFIGS, {}],
    extra_paths=_CONFIG_KEY_PATHS,
    values=st.one_of(st.sampled_from(_NASTY_NUMBERS), _JSON_VALUES),
)


def _assert_one_line(error, prefix=""):
    message = str(error)
    assert type(error) is UserInputError
    assert len(message.splitlines()) == 1, repr(message)
    assert message.startswith(prefix), message


def _json_text(value):
    # As a user (or a JSON library) would write it; NaN and Infinity included,
    # which Python's json module reads.
    return json.dumps(value)


@_fuzz_settings(max_examples=300)
@given(values=_CONFIGS)
def test_config_from_dict_returns_a_config_or_raises_one_line(values):
    try:
        config = TrainConfig.from_dict(values, source="fuzz")
    except UserInputError as error:
        _assert_one_line(error, prefix="fuzz: ")
        return
    # What a run writes to model_dir/config.json reads back as the same config.
    assert TrainConfig.from_dict(json.loads(config.to_json())).to_json() == config.to_json()
    # Its numbers are finite; model.options are the model builder's to check.
    settings = config.to_dict()
    del settings["model"]["options"]
    json.loads(json.dumps(settings), parse_constant=_refuse)


def _refuse(constant):
    raise AssertionError(f"accepted a non-finite number: {constant}")


_TEXT_DOCUMENTS = st.one_of(
    _CONFIGS.map(_json_text),
    st.text(max_size=30),
    st.sampled_from(
        [
            "",
            "{",
            '{"steps": }',
            "[" * 5000 + "]" * 5000,
            '{"a": ' * 5000 + "1" + "}" * 5000,
            '{"steps": ' + "9" * 5000 + "}",
            '{"steps": 1e999}',
            '{"steps": NaN}',
            "\ufeff{}",
            '{"\\ud800": 1}',
            '{"a\\nb": 1}',
        ]
    ),
)


@_fuzz_settings(max_examples=100)
@given(text=_TEXT_DOCUMENTS)
def test_config_text_parses_or_raises_one_line(text):
    try:
        values = parse_json_object(text, "--config_override")
        config = TrainConfig().merged(values, source="--config_override")
    except UserInputError as error:
        _assert_one_line(error, prefix="--config_override: ")
        return
    assert isinstance(config, TrainConfig)


_FLAG_VALUES = st.fixed_dictionaries(
    {},
    optional={
        name: _JSON_VALUES
        for name in (
            "precision",
            "manifest",
            "strategy",
            "virtual_cpus",
            "tpu",
            "auto_promote",
            "jit_compile",
            "steps",
        )
    },
)


@_fuzz_settings(max_examples=100)
@given(document=_TEXT_DOCUMENTS, override=st.one_of(st.none(), _TEXT_DOCUMENTS), flags=_FLAG_VALUES)
def test_resolve_config_returns_a_config_or_raises_one_line(tmp_path, document, override, flags):
    path = tmp_path / "run.json"
    path.write_text(document, encoding="utf-8", errors="surrogatepass")
    try:
        config = resolve_config(path, override, **flags)
    except UserInputError as error:
        _assert_one_line(error)
        return
    assert isinstance(config, TrainConfig)


# Manifests: rules with bad regexes, policies, keys; applied to a tiny model.

_POLICIES = st.sampled_from(["float32", "mixed_float16", "mixed_bfloat16"])
_REGEXES = [".*", "dense", "dense|norm", "norm", "(", "[", "a{4294967296}", "(" * 500 + ")" * 500]
_REGEXES += ["\\", "(?P<a>x)(?P=b)", "\\N{nope}", "a\nb(", "(?<=a+)b", "*", "(?i)DENSE"]
_RULES = st.fixed_dictionaries(
    {
        "match": st.fixed_dictionaries(
            {},
            optional={
                "path": st.one_of(st.sampled_from(_REGEXES), st.text(max_size=8), _JSON_VALUES),
                "class": st.one_of(
                    st.sampled_from(["Dense", "Layer", "LayerNormalization", "Norm"]), _JSON_VALUES
                ),
            },
        ),
        "policy": st.one_of(_POLICIES, _POLICIES, _JSON_VALUES),
    },
    optional={"reason": st.one_of(st.text(max_size=8), _JSON_VALUES)},
)
_GENERATED_MANIFESTS = st.builds(
    lambda rules, default, safe: {
        "version": 1,
        "default": default,
        "safe_defaults": safe,
        "rules": rules,
    },
    st.lists(_RULES, max_size=4),
    _POLICIES,
    st.booleans(),
)
_MANIFESTS = st.one_of(
    _GENERATED_MANIFESTS,
    _mutated(MANIFESTS, values=st.one_of(_POLICIES, st.sampled_from(_REGEXES), _JSON_VALUES)),
    _mutated(
        [
            {
                "version": 1,
                "default": "float32",
                "rules": [{"match": {"path": "dense"}, "policy": "float32"}],
            }
        ],
        values=st.one_of(_POLICIES, st.sampled_from(_REGEXES), _JSON_VALUES),
    ),
)


def _tiny_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="dense")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


@_fuzz_settings(max_examples=200)
@given(values=_MANIFESTS)
def test_manifest_parses_and_applies_or_raises_one_line(values):
    try:
        manifest = PrecisionManifest.from_dict(values, source="fuzz.json")
    except UserInputError as error:
        _assert_one_line(error, prefix="fuzz.json: ")
        return
    assert PrecisionManifest.from_dict(json.loads(manifest.to_json())) == manifest
    report = manifest.apply(_tiny_model())
    assert set(report.policies) == {"dense", "norm", "logits"}


@_fuzz_settings(max_examples=100)
@given(
    path=st.one_of(st.sampled_from(_REGEXES), st.text(st.sampled_from("()[]{}|*+?\\^$.a0,<=!P:"))),
    policy=_POLICIES,
)
def test_manifest_rule_regex_compiles_or_raises_one_line(path, policy):
    rule = {"match": {"path": path}, "policy": policy}
    try:
        manifest = PrecisionManifest.from_dict(
            {"version": 1, "default": "float32", "rules": [rule]}
        )
    except UserInputError as error:
        _assert_one_line(error, prefix="manifest: rules[0].")
        return
    manifest.apply(_tiny_model())


@_fuzz_settings(max_examples=60)
@given(text=st.one_of(_MANIFESTS.map(_json_text), _TEXT_DOCUMENTS))
def test_manifest_file_parses_or_raises_one_line(tmp_path, text):
    path = tmp_path / "manifest.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        PrecisionManifest.from_json(path)
    except UserInputError as error:
        _assert_one_line(error, prefix=f"{path}: ")


# Launcher flags, each launcher run in this process (tests/launchers.py):
# mpt-train with `--dry_run` always last, so nothing trains; mpt-calibrate and
# mpt-validate with their heavy work stubbed.

_FLAG_TEXT = st.one_of(
    st.sampled_from(["", "0", "-1", "1", "2", "1e3", "nan", "inf", "true", "none", "a\nb"]),
    st.sampled_from(["\u2028", "\x85", "é", "--", "=", "{}", "[1]", "float32", "mixed_float16"]),
    st.integers(-(2**70), 2**70).map(str),
    st.text(max_size=6),
)


def _override_text(values):
    # The file's data_dir (the session's prepared datasets) stays, so that a
    # dry run never prepares a dataset elsewhere.
    if isinstance(values, dict) and isinstance(values.get("data"), dict):
        values["data"].pop("data_dir", None)
    return json.dumps(values)


def _launcher_flags(names, paths):
    """Lists of `--name=value` flags of `names`, with paths from `paths`."""
    value = st.one_of(_FLAG_TEXT, st.sampled_from(sorted(paths.values())))
    name_value = st.builds(lambda name, text: f"--{name}={text}", st.sampled_from(names), value)
    flag = st.one_of(
        name_value,
        name_value,
        name_value,
        st.builds(
            lambda overrides: f"--config_override={_override_text(overrides)}",
            _mutated(
                [{}, {"steps": 2, "data": {"batch_size": 8}}],
                # Not model.options: a huge layer width would allocate as much memory.
                extra_paths=[
                    path for path in _CONFIG_KEY_PATHS if path[:2] != ("model", "options")
                ],
                values=st.one_of(st.sampled_from(_NASTY_NUMBERS), _JSON_VALUES),
            ),
        ),
        st.builds(lambda path: f"--config={path}", st.sampled_from(sorted(paths.values()))),
        st.sampled_from(["--bogus=1", "positional", "--steps", "--nosteps"]),
    )
    return st.lists(flag, max_size=4)


def _fuzz_files(directory, tfds_dir):
    """Config and manifest files a user might pass, good and bad."""
    config = dict(CONFIGS[0], data={**CONFIGS[0]["data"], "data_dir": tfds_dir})
    files = {
        "config": json.dumps(config),
        "manifest": json.dumps(MANIFESTS[0]),
        "not_json": "{",
        "latin1": b'{"steps": "\xff"}',
        "deep": "[" * 5000 + "]" * 5000,
        "bad_manifest": json.dumps({"version": 1, "default": "float32", "rules": [{"match": {}}]}),
    }
    paths = {"missing": str(directory / "missing.json"), "directory": str(directory)}
    for name, content in files.items():
        path = directory / f"{name}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        paths[name] = str(path)
    return paths


def _assert_usage_error_or_success(program, status, stderr):
    assert "Traceback" not in stderr, stderr
    if status in (0, None):
        return
    assert status == 2, (status, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith(f"{program}: error: ")]
    assert len(errors) == 1 and stderr.endswith(errors[0] + "\n"), stderr
    assert stderr.count("\n") == 1, stderr


TRAIN_FLAGS = (
    "precision",
    "manifest",
    "strategy",
    "virtual_cpus",
    "tpu",
    "jit_compile",
    "steps",
    "auto_promote",
    "canary_steps",
    "model_dir",
)


@pytest.fixture
def train_in_process(tmp_path, tfds_dir, monkeypatch):
    """Runs mpt-train here; returns (exit status, stderr)."""
    monkeypatch.chdir(tmp_path)  # Relative paths a fuzzed flag names land here.

    def launch(argv):
        launched = launch_in_process("mpt-train", *argv)
        return launched.status, launched.stderr

    return launch


@pytest.fixture(scope="module")
def fuzz_files(tmp_path_factory, tfds_dir):
    return _fuzz_files(tmp_path_factory.mktemp("fuzz_files"), tfds_dir)


def test_train_flags_fuzzed_exit_with_one_line_or_run(train_in_process, fuzz_files, tmp_path):
    @_fuzz_settings(max_examples=100)
    @given(flags=_launcher_flags(TRAIN_FLAGS, fuzz_files))
    def check(flags):
        argv = [f"--config={fuzz_files['config']}", f"--model_dir={tmp_path / 'run'}", *flags]
        status, stderr = train_in_process([*argv, "--dry_run"])
        _assert_usage_error_or_success("mpt-train", status, stderr)

    check()


def _nested(path, value):
    for key in reversed(path):
        value = {key: value}
    return value


def test_train_config_values_fuzzed_exit_with_one_line_or_run(
    train_in_process, fuzz_files, tmp_path
):
    # One key at a time, so that the rest of the config is valid and the dry
    # run reaches what uses the value (data loading, model building, seeding).
    paths = [path for path in _CONFIG_KEY_PATHS if path[:2] != ("model", "options")]

    @_fuzz_settings(max_examples=30)
    @given(path=st.sampled_from(paths), value=st.sampled_from(_NASTY_NUMBERS + _NASTY_TEXT))
    @example(path=("seed",), value=-1)  # NumPy's seeding raised ValueError mid dry run.
    def check(path, value):
        override = json.dumps(_nested(path, value))
        status, stderr = train_in_process(
            [
                f"--config={fuzz_files['config']}",
                f"--model_dir={tmp_path / 'run'}",
                f"--config_override={override}",
                "--dry_run",
            ]
        )
        _assert_usage_error_or_success("mpt-train", status, stderr)

    check()


# mpt-calibrate and mpt-validate: the calibration or validation itself is
# replaced by an exit 0 (flag and config checks come before it).
CALIBRATE_FLAGS = ("output", "stats_output", "steps", "config")
VALIDATE_FLAGS = ("precision", "manifest", "output", "tensorboard_dir", "steps", "output_rtol")
VALIDATE_FLAGS += ("min_top1_agreement", "max_kl", "max_metric_delta", "max_loss_gap")


@pytest.mark.parametrize(
    "stubbed, program, names, required",
    [
        ("mpt_keras.run_calibration", "mpt-calibrate", CALIBRATE_FLAGS, []),
        (
            "mpt_keras.run_validation",
            "mpt-validate",
            VALIDATE_FLAGS,
            ["--precision=mixed_bfloat16"],
        ),
    ],
)
def test_calibrate_and_validate_flags_fuzzed_exit_with_one_line(
    fuzz_files, tmp_path, monkeypatch, stubbed, program, names, required
):
    monkeypatch.chdir(tmp_path)  # Relative paths a fuzzed flag names land here.

    @_fuzz_settings(max_examples=30)
    @given(flags=_launcher_flags(names, fuzz_files))
    def check(flags):
        output = f"--output={tmp_path / 'out.json'}"
        argv = [f"--config={fuzz_files['config']}", output, *required, *flags]
        launched = launch_in_process(program, *argv)
        assert launched.status != "traceback", (argv, launched.stderr)
        _assert_usage_error_or_success(program, launched.status, launched.stderr)

    with mock.patch(stubbed, side_effect=SystemExit(0)):
        check()

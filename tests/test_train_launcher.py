"""End-to-end tests of the mpt-train launcher, run as a user runs it.

The installed `mpt-train` runs in its own process once: on an unwritable
`model_dir` it fails after importing TensorFlow, whose native start-up lines
only a new process would show. `python -m` resumes, in a process of its own, a
run started here. The other cases run the entry point in this process
(tests/launchers.py).
"""

import json
import os
import socket
import subprocess
import sys

import pytest
from launchers import launch_console_script, launch_in_process

from mpt_keras.precision.hardware import resolve_auto_policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")


def _python_dash_m(*flags):
    command = [sys.executable, "-m", "trainers.train", *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def _tiny(tfds_dir, model=True):
    """Checkpoints and validation every 2 steps on a few examples; `model`: the MLP's
    hidden layers shrunk to one of 16 units (for configs/digits_mlp.json only)."""
    override = {
        "checkpoint_every": 2,
        "eval_every": 2,
        "data": {"data_dir": tfds_dir, "batch_size": 16, "eval_examples": 32},
    }
    if model:
        override["model"] = {"options": {"hidden_units": [16]}}
    return json.dumps(override)


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_each_precision_trains_end_to_end(tfds_dir, tmp_path, precision):
    model_dir = str(tmp_path / "run")
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        f"--precision={precision}",
        "--steps=4",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 0, result.stderr
    with open(os.path.join(model_dir, "metrics.json")) as file:
        metrics = json.load(file)
    assert (metrics["step"], metrics["precision"]) == (4, precision)
    with open(os.path.join(model_dir, "config.json")) as file:
        assert json.load(file)["precision"] == precision
    assert sorted(os.listdir(model_dir)) == [
        "checkpoints",
        "config.json",
        "logs",
        "metrics.csv",
        "metrics.json",
        "model.keras",
        "precision_report.json",
        "saved_model",
        "serving.keras",
    ]
    assert "Traceback" not in result.stderr


def test_python_dash_m_resumes_to_the_exact_step(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    flags = [
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        f"--config_override={_tiny(tfds_dir)}",
    ]
    first = launch_in_process("mpt-train", *flags, "--steps=2")
    assert first.status == 0, first.stderr
    second = _python_dash_m(*flags, "--steps=4")
    assert second.returncode == 0, second.stderr
    assert f"Resumed from {model_dir}/checkpoints/step-2 at step 2." in second.stderr
    with open(os.path.join(model_dir, "metrics.json")) as file:
        assert json.load(file)["step"] == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--precision=float8"],
            "flag --precision=float8: value should be one of "
            "<float32|mixed_float16|mixed_bfloat16|auto>",
        ),
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        # Found by tests/test_fuzz.py: absl quotes the value, line break and all.
        (
            ["--precision=float\n32"],
            "flag --precision=float\\n32: value should be one of "
            "<float32|mixed_float16|mixed_bfloat16|auto>",
        ),
        (["--steps=0"], "flag --steps=0: 0 is not a positive integer"),
        (
            ["--config={missing}"],
            "{missing}: no such file",
        ),
        (
            ["--config={malformed}"],
            "{malformed}: malformed JSON at line 1 column 11: Expecting value",
        ),
        (
            ["--config={unknown_key}"],
            "{unknown_key}: unknown key 'optimiser'. Allowed keys: precision, manifest, seed, "
            "steps, checkpoint_every, eval_every, keep_checkpoints, log_every, strategy, "
            "virtual_cpus, tpu, jit_compile, auto_promote, deterministic, saved_model, imports, "
            "data, model, loss, metrics, optimizer, loss_scale, divergence",
        ),
        (
            ['--config_override={{"data": {{"name": "no_such_set"}}}}'],
            "Unknown dataset 'no_such_set'",
        ),
        (
            ['--config_override={{"data": {{"name": "mnist", "data_dir": "{empty}"}}}}'],
            "Dataset 'mnist' is not prepared in {empty} and cannot be downloaded here",
        ),
        (["--config_override=[1]"], "--config_override: expected a JSON object, received list"),
        (["extra"], "unexpected positional arguments extra; all options are --flags"),
        (
            ["--precision=float32", "--manifest={manifest}"],
            "--precision and --manifest exclude each other: a manifest decides every layer's "
            "policy (its 'default' and rules). Allowed: one of them",
        ),
        (
            ["--census_target=h100"],
            "--census_target=h100 without --dry_run: the census compiles the step for that GPU "
            "and never runs it. Allowed: with --dry_run",
        ),
        (
            ["--census_target=h100", "--dry_run"],
            "mpt-train --census_target runs on Keras backend jax, and Keras has tensorflow",
        ),
        (
            ["--census_target=a100"],
            "flag --census_target=a100: value should be one of <h100|h200>",
        ),
        (
            ["--manifest={bad_manifest}"],
            '{bad_manifest}: rules[0].policy: received "float16". Allowed: float32, '
            "mixed_float16, mixed_bfloat16",
        ),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_status_2(tmp_path, flags, message):
    paths = {
        "missing": str(tmp_path / "missing.json"),
        "malformed": str(tmp_path / "malformed.json"),
        "unknown_key": str(tmp_path / "unknown_key.json"),
        "empty": str(tmp_path / "empty_tfds"),
        "manifest": os.path.join(REPO, "configs", "manifests", "digits_cnn.json"),
        "bad_manifest": str(tmp_path / "bad_manifest.json"),
    }
    bad_rule = {"match": {"path": "x"}, "policy": "float16"}
    (tmp_path / "bad_manifest.json").write_text(
        json.dumps({"version": 1, "default": "float32", "rules": [bad_rule]})
    )
    (tmp_path / "malformed.json").write_text('{"steps": }')
    (tmp_path / "unknown_key.json").write_text('{"optimiser": {}}')
    os.makedirs(paths["empty"])
    flags = [flag.format(**paths) for flag in flags]
    if not any(flag.startswith("--config=") for flag in flags):
        flags.append(f"--config={CONFIG}")
    result = launch_in_process("mpt-train", *flags, f"--model_dir={tmp_path / 'run'}")
    assert result.status == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mpt-train: error: " + message.format(**paths)), lines[0]


def test_a_missing_manifest_is_named_by_its_flag(tmp_path):
    missing = str(tmp_path / "missing.json")
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={tmp_path / 'run'}",
        f"--manifest={missing}",
    )
    assert (result.status, result.stderr) == (
        2,
        f"mpt-train: error: --manifest: key 'manifest': no such file '{missing}'\n",
    )


def test_unwritable_model_dir_is_one_line_before_training(tfds_dir, tmp_path):
    (tmp_path / "file").write_text("")
    model_dir = tmp_path / "file" / "run"
    result = launch_console_script(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        "--steps=2",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 2
    assert result.stderr.splitlines() == [
        f"mpt-train: error: model_dir: received {model_dir} (cannot be created: Not a directory). "
        "Allowed: a directory that can be created and written, with at least 64 MiB free"
    ]
    assert result.stdout == ""  # Nothing trained: no progress bar, no metrics.


def test_a_metrics_port_in_use_is_one_line_before_training(tfds_dir, tmp_path):
    model_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launch_in_process(
            "mpt-train",
            f"--config={CONFIG}",
            f"--model_dir={model_dir}",
            f"--metrics_port={port}",
            f"--config_override={_tiny(tfds_dir)}",
        )
    assert result.status == 2
    assert result.stderr.splitlines()[-1] == (
        f"mpt-train: error: metrics_port {port}: already in use on 0.0.0.0; allowed: a free "
        "TCP port (or no --metrics_port: no Prometheus endpoint)"
    )
    assert not model_dir.exists()


def test_manifest_and_dry_run_print_the_layers_and_write_nothing(tfds_dir, tmp_path):
    model_dir = tmp_path / "run"
    manifest = os.path.join(REPO, "configs", "manifests", "digits_cnn.json")
    result = launch_in_process(
        "mpt-train",
        f"--config={os.path.join(REPO, 'configs', 'digits_cnn.json')}",
        f"--model_dir={model_dir}",
        f"--manifest={manifest}",
        "--dry_run",
        f"--config_override={_tiny(tfds_dir, model=False)}",
    )
    assert result.status == 0, result.stderr
    assert result.stdout.splitlines() == [
        "path     class         policy          decided_by",
        "conv_0   Conv2D        float32         rules[0] (path 'conv_0')",
        "pool_0   MaxPooling2D  mixed_bfloat16  default",
        "conv_1   Conv2D        mixed_bfloat16  default",
        "pool_1   MaxPooling2D  mixed_bfloat16  default",
        "flatten  Flatten       mixed_bfloat16  default",
        "dense    Dense         mixed_bfloat16  default",
        "dropout  Dropout       mixed_bfloat16  default",
        "logits   Dense         float32         safe default: model output",
    ]
    assert not model_dir.exists()


def test_dry_run_shows_the_float8_layers(tfds_dir, tmp_path):
    override = json.dumps(
        {
            "model": {"options": {"num_layers": 1, "d_model": 16, "num_heads": 2}},
            "data": {"data_dir": tfds_dir, "sequence_length": 16, "eval_examples": 8},
        }
    )
    result = launch_in_process(
        "mpt-train",
        f"--config={os.path.join(REPO, 'configs', 'python_source_transformer.json')}",
        f"--model_dir={tmp_path / 'run'}",
        "--manifest="
        + os.path.join(REPO, "configs", "manifests", "python_source_transformer_float8.json"),
        "--dry_run",
        f"--config_override={override}",
    )
    assert result.status == 0, result.stderr
    table, census = result.stdout.split("\nfloat8 census, ")
    float8 = [line.split()[:3] for line in table.splitlines() if "float8" in line]
    assert float8 == [
        [f"block_0/{path}", layer_class, "float8_from_mixed_bfloat16"]
        for path, layer_class in [
            ("attention/query", "EinsumDense"),
            ("attention/key", "EinsumDense"),
            ("attention/value", "EinsumDense"),
            ("attention/attention_output", "EinsumDense"),
            ("mlp_up", "Dense"),
            ("mlp_down", "Dense"),
        ]
    ]
    # The compiled step's census: on a CPU every float8 GEMM (3 a layer) is emulated.
    summary, header, *gemms = census.splitlines()
    assert summary == (
        "emulated: 0 of 18 GEMMs of 6 float8 layers run in float8 "
        "(no GPU: this machine has no float8 matmul units)"
    )
    assert [(row.split()[0], row.split()[-1]) for row in gemms[:3]] == [
        ("block_0/attention/query", "emulated")
    ] * 3
    assert not (tmp_path / "run").exists()


def test_precision_auto_says_why(tfds_dir, tmp_path):
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={tmp_path / 'run'}",
        "--precision=auto",
        "--dry_run",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 0, result.stderr
    # What this machine gets (tests/test_policies.py fakes each kind of machine).
    policy, reason = resolve_auto_policy()
    assert f"precision auto -> {policy}: {reason}" in result.stderr


def test_canary_lets_a_healthy_run_through_and_records_it(tfds_dir, tmp_path):
    model_dir = tmp_path / "run"
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        "--precision=mixed_bfloat16",
        "--canary_steps=4",
        "--steps=2",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 0, result.stderr
    canary = json.loads((model_dir / "canary.json").read_text())
    assert canary["diverged"] is False
    assert json.loads((model_dir / "metrics.json").read_text())["step"] == 2


def test_canary_stops_a_run_that_diverges(tfds_dir, tmp_path):
    model_dir = tmp_path / "run"
    override = json.loads(_tiny(tfds_dir))
    override["optimizer"] = {"learning_rate": 1e6, "schedule": "constant", "warmup_steps": 0}
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        "--precision=mixed_float16",
        "--canary_steps=6",
        f"--config_override={json.dumps(override)}",
    )
    assert result.status == 2
    lines = result.stderr.splitlines()
    assert lines[-1].startswith("mpt-train: error: canary: "), result.stderr
    assert lines[-1].endswith("; the full run was not started")
    assert json.loads((model_dir / "canary.json").read_text())["diverged"] is True
    assert not (model_dir / "metrics.json").exists()

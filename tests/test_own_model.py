"""A user's own model, data and loss through every launcher, as a new user runs them.

The models are the ones `examples/` ships: a `keras.applications` MobileNet
(v1, 91 layers), a keras_hub GPT-2 built from arguments (no preset, no network)
and a subclassed CNN, fed by data factories over data that ships offline, each
cut small, a few steps each. The launchers run in this process
(tests/launchers.py), as their flags and factories are the point; the subclassed
model's, on two replicas, in the two-CPU host (tests/replicas.py), as splitting the
CPU needs a process of its own; and the first config error is checked in a process
that has not imported TensorFlow.
"""

import json
import os
import subprocess
import sys

import pytest
from launchers import launch_in_process
from replicas import on_two_cpus, run_on_two_cpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOBILENET = os.path.join(REPO, "examples", "configs", "mobilenet_digits.json")
GPT2 = os.path.join(REPO, "examples", "configs", "gpt2_python_source.json")
# Few small steps; no XLA, whose compilation would dominate.
QUICK = {"jit_compile": "false", "checkpoint_every": 2, "eval_every": 2}


def _launch(launcher, *flags, env=None):
    return subprocess.run(
        [sys.executable, "-m", f"trainers.{launcher}", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _override(tfds_dir, model=None, **data):
    model = {"model": {"options": model}} if model else {}
    return json.dumps({**QUICK, **model, "data": {"data_dir": tfds_dir, **data}})


def _read(path):
    with open(path) as file:
        return json.load(file)


def test_a_keras_applications_model_calibrates_and_trains(tfds_dir, tmp_path):
    override = _override(tfds_dir, batch_size=4, eval_examples=8)
    manifest = str(tmp_path / "mobilenet.json")
    calibrated = launch_in_process(
        "mpt-calibrate",
        f"--config={MOBILENET}",
        f"--config_override={override}",
        "--steps=1",
        f"--output={manifest}",
    )
    assert calibrated.status == 0, calibrated.stderr
    decided = _read(manifest.replace(".json", ".stats.json"))["layers"]
    # Measured layer by layer inside the application, not as one unit.
    assert {"conv1", "conv_dw_1", "conv_pw_1", "conv_preds"} <= set(decided)

    model_dir = str(tmp_path / "run")
    trained = launch_in_process(
        "mpt-train",
        f"--config={MOBILENET}",
        f"--model_dir={model_dir}",
        f"--manifest={manifest}",
        "--steps=2",
        f"--config_override={override}",
        "--nosaved_model",  # The keras_hub run below exports a user's model.
    )
    assert trained.status == 0, trained.stderr
    assert "saved_model" not in os.listdir(model_dir)
    metrics = _read(os.path.join(model_dir, "metrics.json"))
    assert (metrics["step"], sorted(metrics)[-2:]) == (2, ["val_accuracy", "val_loss"])
    assert _read(os.path.join(model_dir, "config.json"))["model"]["factory"] == (
        "examples.user_models:mobilenet"
    )
    # A MobileNet validated against float32: the README's `mpt_keras.validate` example, which
    # tests/test_docs.py runs; `mpt-validate` on a user's model: the keras_hub test below.


def test_a_keras_hub_model_trains_calibrates_and_validates(tfds_dir, tmp_path):
    # One block of width 16 over 8 tokens, not the config's two of 32: half the blocks to trace.
    override = _override(
        tfds_dir,
        model={"num_layers": 1, "num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32},
        batch_size=4,
        eval_examples=8,
        options={"sequence_length": 8},
    )
    manifest = str(tmp_path / "gpt2.json")
    calibrated = launch_in_process(
        "mpt-calibrate",
        f"--config={GPT2}",
        f"--config_override={override}",
        "--steps=1",
        f"--output={manifest}",
    )
    assert calibrated.status == 0, calibrated.stderr

    model_dir = str(tmp_path / "run")
    trained = launch_in_process(
        "mpt-train",
        f"--config={GPT2}",
        f"--model_dir={model_dir}",
        f"--manifest={manifest}",
        "--steps=2",
        f"--config_override={override}",
    )
    assert trained.status == 0, trained.stderr
    assert _read(os.path.join(model_dir, "metrics.json"))["step"] == 2
    assert os.path.isfile(os.path.join(model_dir, "saved_model", "saved_model.pb"))
    layers = _read(os.path.join(model_dir, "precision_report.json"))["layers"]
    # Reported layer by layer inside the backbone's block, not as one unit.
    assert "gpt2_backbone/transformer_layer_0/self_attention/query" in {
        layer["path"] for layer in layers
    }

    validated = launch_in_process(
        "mpt-validate",
        f"--config={GPT2}",
        f"--manifest={manifest}",
        "--steps=2",
        f"--config_override={override}",
        f"--output={tmp_path / 'report.json'}",
    )
    assert validated.status in (0, 1), validated.stderr
    assert _read(tmp_path / "report.json")["candidate"] == manifest


def test_a_config_error_comes_before_tensorflow_is_imported(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"model": {"factory": "examples.user_models"}}))
    # TensorFlow cannot be imported at all here: the error must come before it is tried.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('tensorflow', 'keras'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    result = _launch(
        "train",
        f"--config={config}",
        f"--model_dir={tmp_path / 'run'}",
        env={"PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"},
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"mpt-train: error: {config}: key 'model.factory': received \"examples.user_models\". "
        "Allowed: 'package.module:attribute'\n",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "launcher, groups",
    [
        ("train", ["The run:", "Precision:", "Backend, distribution and XLA:"]),
        ("validate", ["The candidate and its run:", "Thresholds:"]),
        ("calibrate", ["Calibration:"]),
        ("bench", ["What is compared:", "How it is measured:", "The models' sizes:"]),
    ],
)
def test_help_shows_the_launchers_own_flags_grouped_with_defaults(launcher, groups):
    result = launch_in_process(f"mpt-{launcher}", "--help")
    assert result.status == 0, result.stderr
    lines = result.stdout.splitlines()
    titles = [line for line, after in zip(lines, lines[1:]) if after.startswith("  --")]
    assert [title for title in titles if not title.startswith("  --")] == groups
    assert launcher == "bench" or "  --config: Run config file (JSON). (required)" in lines
    assert not any("test_tmpdir" in line or "--verbosity" in line for line in lines)


@on_two_cpus
def test_a_subclassed_model_trains_mirrored_with_xla_and_resumes(tmp_path):
    model_dir = str(tmp_path / "run")
    first, resumed = run_on_two_cpus("test_own_model", "_subclassed_runs", model_dir)
    assert first[0] == 0, first[1]
    assert resumed[0] == 0, resumed[1]
    assert "Training steps 3..4" in resumed[1]
    metrics = _read(os.path.join(model_dir, "metrics.json"))
    assert (metrics["step"], metrics["precision"]) == (4, "mixed_bfloat16")
    report = _read(os.path.join(model_dir, "precision_report.json"))
    assert report["jit_compile"] is True
    assert {layer["path"]: layer["policy"] for layer in report["layers"]} == {
        "conv2d": "mixed_bfloat16",
        "global_average_pooling2d": "mixed_bfloat16",
        "dense": "float32",
    }
    # The subclassed model exports for serving from under the strategy too.
    assert os.path.isfile(os.path.join(model_dir, "saved_model", "saved_model.pb"))


def _subclassed_runs(model_dir: str) -> list[tuple[int | str, str]]:
    """In the two-CPU host: 2 steps of the subclassed CNN on two replicas with XLA, then a
    resume to 4 in the same process (a resume in a fresh one: test_train_launcher.py); each
    run's (exit status, stderr)."""
    config = os.path.join(REPO, "examples", "configs", "small_cnn_digits.json")
    # 4 filters over 8x8 digits, 2 a replica: little for XLA to compile (the config: 16, 16x16).
    override = json.dumps(
        {
            "checkpoint_every": 2,
            "eval_every": 2,
            "model": {"options": {"filters": 4}},
            "data": {"options": {"image_size": 8}, "batch_size": 4, "eval_examples": 8},
        }
    )
    flags = [
        f"--config={config}",
        f"--model_dir={model_dir}",
        f"--config_override={override}",
        "--strategy=mirrored",
        "--virtual_cpus=2",
        "--jit_compile=true",
    ]
    runs = [launch_in_process("mpt-train", *flags, f"--steps={steps}") for steps in (2, 4)]
    return [(run.status, run.stderr) for run in runs]


def test_a_model_from_a_keras_file_trains_with_its_compiled_loss(tmp_path):
    import keras

    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    logits = keras.layers.Dense(10, name="logits")(keras.layers.Flatten()(hidden))
    mine = keras.Model(inputs, logits)
    mine.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    mine.save(tmp_path / "mine.keras")
    config = tmp_path / "from_file.json"
    config.write_text(
        json.dumps(
            {
                "precision": "mixed_bfloat16",
                "checkpoint_every": 2,
                "eval_every": 2,
                "model": {"file": str(tmp_path / "mine.keras")},
                "data": {
                    "factory": "examples.user_data:digits_rgb",
                    "options": {"image_size": 8},
                    "batch_size": 8,
                    "eval_examples": 16,
                },
            }
        )
    )
    model_dir = tmp_path / "run"
    trained = launch_in_process(
        "mpt-train", f"--config={config}", f"--model_dir={model_dir}", "--steps=2"
    )
    assert trained.status == 0, trained.stderr
    metrics = _read(model_dir / "metrics.json")
    assert (metrics["step"], sorted(metrics)[-2:]) == (2, ["val_accuracy", "val_loss"])
    policies = {
        layer["path"]: layer["policy"]
        for layer in _read(model_dir / "precision_report.json")["layers"]
    }
    assert policies == {
        "conv": "mixed_bfloat16",
        "flatten": "mixed_bfloat16",
        "logits": "float32",
    }

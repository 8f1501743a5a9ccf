"""End-to-end tests of the mpt-calibrate launcher, and mpt-train on what it writes.

The first calibration runs the installed `mpt-calibrate` in its own process;
everything else runs the launchers' entry points in this one (tests/launchers.py).
"""

import json
import os

import pytest
from launchers import launch_console_script, launch_in_process

from mpt_keras import PrecisionManifest, Rule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")


def _tiny(tfds_dir):
    return json.dumps(
        {
            "checkpoint_every": 2,
            "eval_every": 2,
            "data": {"data_dir": tfds_dir, "batch_size": 16, "eval_examples": 32},
        }
    )


def test_the_calibrated_manifest_trains_with_mpt_train(tfds_dir, tmp_path):
    manifest = str(tmp_path / "manifests" / "mlp.json")
    calibrated = launch_console_script(
        "mpt-calibrate",
        f"--config={CONFIG}",
        "--steps=2",
        f"--output={manifest}",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert calibrated.status == 0, calibrated.stderr
    with open(str(tmp_path / "manifests" / "mlp.stats.json")) as file:
        statistics = json.load(file)
    assert statistics["steps"] == 2
    assert {path: layer["policy"] for path, layer in statistics["layers"].items()} == {
        "flatten": "mixed_float16",
        "dense_0": "mixed_float16",
        "dropout_0": "mixed_float16",
        "dense_1": "mixed_float16",
        "dropout_1": "mixed_float16",
        "logits": "float32",
    }
    # The table printed (after TFDS' lines when it prepares the dataset): a
    # header and one line per layer.
    lines = calibrated.stdout.splitlines()
    lines = lines[[line.startswith("path ") for line in lines].index(True) :]
    assert lines[0].split() == [
        "path", "class", "act_max", "fp16_err", "bf16_err", "policy", "reason"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[1:]] == list(statistics["layers"])

    model_dir = str(tmp_path / "run")
    trained = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={model_dir}",
        f"--manifest={manifest}",
        "--steps=2",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert trained.status == 0, trained.stderr
    with open(os.path.join(model_dir, "precision_report.json")) as file:
        report = json.load(file)
    # The config says float32: mixed_float16 layers come from the manifest.
    assert (report["manifest"], report["precision"]) == (manifest, "mixed_float16")
    assert {layer["path"]: layer["policy"] for layer in report["layers"]} == {
        path: layer["policy"] for path, layer in statistics["layers"].items()
    }
    with open(os.path.join(model_dir, "metrics.json")) as file:
        assert json.load(file)["step"] == 2


def test_stats_output_puts_the_statistics_where_asked(tfds_dir, tmp_path):
    manifest, stats = str(tmp_path / "m.json"), str(tmp_path / "elsewhere" / "s.json")
    result = launch_in_process(
        "mpt-calibrate",
        f"--config={CONFIG}",
        "--steps=1",
        f"--output={manifest}",
        f"--stats_output={stats}",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "m.json"]
    with open(stats) as file:
        assert json.load(file)["steps"] == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps=0"], "flag --steps=0: 0 is not a positive integer"),
        (["--config={missing}"], "{missing}: no such file"),
        (["--config_override=[1]"], "--config_override: expected a JSON object, received list"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_status_2(tmp_path, flags, message):
    missing = str(tmp_path / "missing.json")
    arguments = [f"--config={CONFIG}", f"--output={tmp_path / 'm.json'}"]
    arguments += [flag.format(missing=missing) for flag in flags]
    result = launch_in_process("mpt-calibrate", *arguments)
    assert result.status == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"mpt-calibrate: error: {message.format(missing=missing)}"
    )
    assert "Traceback" not in result.stderr


def test_float8_writes_a_float8_rule_for_each_layer_recommended(tfds_dir, tmp_path):
    manifest = str(tmp_path / "mlp_float8.json")
    result = launch_in_process(
        "mpt-calibrate",
        f"--config={CONFIG}",
        "--steps=2",
        "--float8",
        "--float8_speed=ignore",
        f"--output={manifest}",
        f"--config_override={_tiny(tfds_dir)}",
    )
    assert result.status == 0, result.stderr
    with open(str(tmp_path / "mlp_float8.stats.json")) as file:
        float8_layers = json.load(file)["float8_layers"]
    dense_0 = (
        "amax: inputs 1, kernel 0.177, output gradient 0.0194; at most 0% saturate and 0% "
        "underflow in e4m3/e5m2 (<= 0.1%, <= 1%) -> float8"
    )
    # 3 of dense_1's 2 x 16 x 64 output gradients, in its second batch, are above
    # the first batch's amax.
    assert {path: (layer["policy"], layer["reason"]) for path, layer in float8_layers.items()} == {
        "dense_0": ("float8", dense_0),
        "dense_1": (
            "mixed_float16",
            "output gradient saturates 0.146% in e5m2 > 0.1% -> not float8",
        ),
        "logits": ("float32", "stays float32 (safe default: model output) -> not float8"),
    }
    assert PrecisionManifest.from_json(manifest) == PrecisionManifest(
        "mixed_float16", (Rule("float8", path="dense_0", reason=dense_0),)
    )
    # The float8 table follows the layers' after an empty line.
    lines = result.stdout.splitlines()
    float8_table = lines[lines.index("") + 1 :]
    assert float8_table[0].split()[:3] == ["path", "class", "in_amax"]
    assert [line.split()[0] for line in float8_table[1:]] == ["dense_0", "dense_1", "logits"]

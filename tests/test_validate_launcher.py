"""End-to-end tests of the mpt-validate launcher, run as a user (or CI) runs it.

The passing candidate runs the installed `mpt-validate` in its own process; the
other cases run its entry point in this one (tests/launchers.py).
"""

import json
import os

import pytest
from launchers import launch_console_script, launch_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")


def _data(tfds_dir):
    """The dataset's directory, and the MLP shrunk to one hidden layer of 16 units."""
    override = {"data": {"data_dir": tfds_dir}, "model": {"options": {"hidden_units": [16]}}}
    return f"--config_override={json.dumps(override)}"


def test_a_passing_candidate_exits_0_and_writes_its_report(tfds_dir, tmp_path):
    output = tmp_path / "validation" / "report.json"
    result = launch_console_script(
        "mpt-validate",
        f"--config={CONFIG}",
        "--precision=mixed_bfloat16",
        f"--output={output}",
        "--steps=3",
        f"--tensorboard_dir={tmp_path / 'tb'}",
        _data(tfds_dir),
    )
    assert result.status == 0, result.stderr
    # TFDS may print its first preparation of the dataset before the report.
    assert "candidate mixed_bfloat16 vs float32: PASS\n" in result.stdout
    assert json.loads(output.read_text())["passed"] is True
    assert sorted(os.listdir(output.parent)) == ["report.json", "report.png", "report.txt"]
    assert sorted(os.listdir(tmp_path / "tb")) == ["candidate", "float32"]
    assert "check failed" not in result.stderr


def test_an_impossible_threshold_exits_1_naming_the_check(tfds_dir, tmp_path):
    output = tmp_path / "report.json"
    result = launch_in_process(
        "mpt-validate",
        f"--config={CONFIG}",
        "--precision=mixed_float16",
        f"--output={output}",
        "--steps=3",
        "--output_rtol=0",
        _data(tfds_dir),
    )
    assert result.status == 1, result.stderr
    failures = [line for line in result.stderr.splitlines() if "check failed" in line]
    assert len(failures) == 1
    assert failures[0].startswith("mpt-validate: check failed: output_relative_error: ")
    assert failures[0].endswith(" (allowed <= 0) FAIL")
    assert "Traceback" not in result.stderr
    assert json.loads(output.read_text())["passed"] is False


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--precision=mixed_float16", "--manifest=m.json"],
            "mpt-validate: error: the candidate: received both --precision and --manifest. "
            "Allowed: exactly one of --precision and --manifest",
        ),
        (
            [],
            "mpt-validate: error: the candidate: received neither. "
            "Allowed: exactly one of --precision and --manifest",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, flags, message):
    result = launch_in_process(
        "mpt-validate", f"--config={CONFIG}", *flags, f"--output={tmp_path / 'report.json'}"
    )
    assert result.status == 2
    assert result.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in result.stderr

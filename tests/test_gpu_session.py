"""benchmarks/gpu_session.py: the one command a lent GPU runs for issue 34, and its dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from launchers import without_tensorflow

from benchmarks.gpu_session import BUDGET_S, MIN_STEP_S, Step, plan, run_session

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Starts a grandchild that outlives it unless its process group is stopped, then overruns.
OVERRUN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open("{output}/grandchild.pid", "w").write(str(child.pid))
    time.sleep(60)
""")


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether `pid` ends within `within_s`: a SIGKILL sent to its group is delivered
    asynchronously, so on a loaded machine it may still run a moment after `killpg`."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:  # A zombie is gone too.
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_step_that_fails_or_overruns_loses_no_other_and_the_budget_holds(tmp_path):
    steps = [
        Step("fails", ("-c", "import sys; print('boom'); sys.exit(3)"), 30),
        Step(
            "writes",
            (
                "-c",
                "import os; os.mkdir('{output}/logs'); "
                "[open(f'{output}/{name}', 'w') for name in ('a.json', 'a.png')]",
            ),
            30,
            drop=("a.png", "logs"),
        ),
        Step("overruns", ("-c", OVERRUN), 3),
        Step("late", ("-c", "print('never')"), 30),
    ]
    records = run_session(steps, str(tmp_path), MIN_STEP_S + 2, dict(os.environ))
    assert [record["outcome"] for record in records[:3]] == [
        "failed: exit status 3",
        "ok",
        "stopped: out of time after 3 s",
    ]
    assert records[0]["output_tail"] == ["boom"]
    assert records[1]["files"] == ["a.json"]  # The chart and the logs dropped.
    pid = int((tmp_path / "overruns" / "grandchild.pid").read_text())
    assert _gone(pid)  # Its whole process group stopped, the grandchild too.
    assert records[3]["outcome"].startswith("not started: ")
    assert int(records[3]["outcome"].split()[2]) < MIN_STEP_S


def test_an_unknown_step_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_session", "--only=mlp,census",
         f"--output={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--only: received census. Allowed: mlp, transformer, mlp_cublas, validate" in done.stderr
    assert os.listdir(tmp_path) == []


def test_the_plan_puts_the_goals_first_within_the_budget_of_under_eight_minutes():
    steps = plan(small=False)
    assert [step.name for step in steps][:2] == ["mlp", "transformer"]  # The two goals.
    assert sum(step.cap_s for step in steps[:2]) <= BUDGET_S < 8 * 60
    assert [step.xla_flags for step in steps].count("--xla_gpu_enable_triton_gemm=false") == 1
    widths = {step.name: step.args[-1] for step in steps if step.name.startswith("mlp_")}
    assert widths == {"mlp_cublas": "--output={output}", "mlp_2048": "--width=2048",
                      "mlp_768": "--width=768"}  # fmt: skip
    # The dry run leaves out the steps that at --small would repeat the mlp step, and caps
    # none: a loaded CPU's pace says nothing of a GPU's (only the budget holds).
    assert [(step.name, step.cap_s) for step in plan(small=True)] == [
        ("mlp", None),
        ("transformer", None),
        ("validate", None),
    ]


@pytest.mark.slow
def test_the_dry_run_runs_each_distinct_step_and_sends_back_what_it_wrote(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_session", "--small", "--budget_s=600",
         f"--output={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=700, env=without_tensorflow(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Each file is named by the day it was written: a run across midnight names two days.
    files = sorted(
        re.sub(r"\d{4}-\d{2}-\d{2}", "<day>", os.path.relpath(os.path.join(folder, name), tmp_path))
        for folder, _, names in os.walk(tmp_path)
        for name in names
    )
    (record_file,) = tmp_path.glob("gpu_session_*.json")
    record = json.loads(record_file.read_text())
    outcomes = {step["step"]: step["outcome"] for step in record["steps"]}
    # Two steps of training (a 1-block Transformer, VALIDATE_SMALL) leave near-uniform logits:
    # the float8 candidate fails the gate (docs/precision.md, Float8); the 50 steps of the GPU
    # run pass it.
    assert outcomes.pop("validate") == "failed: exit status 1"
    # VALIDATE_SMALL reached the child: 2 steps of a 1-block Transformer.
    validated = json.loads((tmp_path / "validate" / "lm_float8.json").read_text())
    assert validated["steps"] == 2
    paths = [layer["path"] for layer in validated["layers"]]
    assert {path.split("/")[0] for path in paths if path.startswith("block_")} == {"block_0"}
    ran = ["mlp", "transformer"]
    assert outcomes == dict.fromkeys(ran, "ok")
    assert files == sorted([
        "gpu_session_<day>.json",
        "mlp/float8_mlp_<day>_cpu.json",
        "transformer/gpu_<day>_cpu.json",
        "validate/lm_float8.json",
        "validate/lm_float8.txt",
    ])  # fmt: skip
    (mlp_file,) = (tmp_path / "mlp").glob("float8_mlp_*_cpu.json")
    mlp = json.loads(mlp_file.read_text())
    assert [row.get("error") for row in mlp["rows"]] == [None] * 4
    # The Transformer's cells, each in a process of its own (tests/test_gpu_check.py runs
    # them in one): each row names its device, and the machine is recorded once, by the
    # first cell, with JAX's version and no TensorFlow.
    (check_file,) = (tmp_path / "transformer").glob("gpu_*_cpu.json")
    check = json.loads(check_file.read_text())
    assert [(row["precision"], row["stack"]) for row in check["rows"]] == [
        ("mixed_bfloat16", "ours"),
        ("float8", "ours"),
    ]
    assert [(row["device_kind"], "machine" in row) for row in check["rows"]] == [("cpu", False)] * 2
    assert check["machine"]["jax"] and "tensorflow" not in check["machine"]
    census = check["rows"][1]["float8_census"]["summary"]
    assert census.startswith("emulated: 0 of 18 GEMMs of 6 float8 layers run in float8")

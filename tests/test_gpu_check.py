"""benchmarks/gpu_check.py's dry run on CPU (`--small`): the script a lent GPU runs once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from launchers import without_tensorflow

from benchmarks import docs_tables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *flags],
        cwd=REPO,
        env=without_tensorflow(),  # As on the GPU machines.
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_dry_run_measures_stock_and_ours_and_makes_the_docs_table(tmp_path):
    # At --small the cells share one process (tests/test_gpu_session.py runs them each in a
    # process of its own, as on a GPU).
    done = _check("--small", "--precisions=float8", "--steps=1", f"--output={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_*_cpu.json")  # Named by the day written (maybe past midnight).
    result = json.loads(path.read_text())
    assert result["benchmark"] == "gpu_check" and result["shape"]["width"] == 32
    assert [(row["precision"], row["stack"]) for row in result["rows"]] == [
        ("float8", "stock"),
        ("float8", "ours"),
    ]
    for row in result["rows"]:
        assert row["median_step_ms"] > 0 and math.isfinite(row["final_loss"])
        # Each cell's device; the machine once, the first cell's.
        assert row["device_kind"] == "cpu" and "machine" not in row
    # Our cell's census of the compiled step: on a CPU, 18 GEMMs (6 layers, 3 each) emulated.
    census = result["rows"][1]["float8_census"]["summary"]
    assert census.startswith("emulated: 0 of 18 GEMMs of 6 float8 layers run in float8")
    ratio = result["ours_over_stock"]["float8"]
    assert ratio == result["rows"][1]["median_step_ms"] / result["rows"][0]["median_step_ms"]
    assert result["machine"]["jax"] and "tensorflow" not in result["machine"]
    assert result["run"]["command"].startswith("python -m benchmarks.gpu_check --small")
    table = docs_tables.section_lines("gpu.json", result)
    assert any(line.startswith("| float8 | ours | ") for line in table)
    assert "JAX " in table[1] and "`python -m benchmarks.gpu_check --small" in table[1]


def test_an_unknown_precision_or_stack_is_one_line():
    done = _check("--precisions=float32,int4")
    assert done.returncode != 0
    assert "--precisions: received int4. Allowed: float32, tf32, mixed_bfloat16" in done.stderr
    done = _check("--stacks=ours,mine")
    assert done.returncode != 0
    assert "--stacks: received mine. Allowed: stock, ours" in done.stderr


def test_a_run_whose_every_cell_failed_writes_nothing_and_says_why_in_one_line(tmp_path):
    shape = '{"width": 30, "heads": 4, "blocks": 1, "tokens": 8, "batch": 2, "vocabulary": 16}'
    done = _check("--precisions=float32", "--stacks=ours", "--per_cell_processes=false",
                  f"--shape={shape}", f"--output={tmp_path}")  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("gpu_check: no cell ran: ")
    assert os.listdir(tmp_path) == []


def test_a_result_without_rows_is_one_line_naming_the_file():
    from benchmarks import gpu_table
    from mpt_keras.errors import UserInputError

    with pytest.raises(UserInputError) as raised:
        gpu_table.markdown_table({"benchmark": "gpu_check", "rows": []}, "gpu.json")
    assert str(raised.value) == "gpu.json: received no rows. Allowed: a gpu_check result"

"""Every pair of launcher flag values, on every bundled config: it trains, or says why in a line.

A pairwise covering array over `mpt-train`'s flags (config x precision or
manifest x jit_compile x deterministic x strategy x auto_promote x
canary_steps x dry_run) keeps the combinations to 16 runs of two steps each:
every value of any flag meets every value of any other flag in some row, and
every pair of the flags that change how a step runs (precision, jit_compile,
strategy) meets in a row that trains. The table was searched for the cheapest
such cover (a Transformer trains in 3 rows, the canary on it is a dry run), and
`test_the_rows_cover_every_pair` proves it covers.
`--precision` and `--manifest` exclude each other (a one-line error, tested
in tests/test_train_launcher.py), so a manifest is one more value of the
precision. The rows run in the two-CPU host, a child process whose CPU is split into two
logical devices first (tests/replicas.py), so that `--strategy=mirrored` has two replicas;
each run calls the launcher in that process (tests/launchers.py) and records its exit
status and what it printed. A run passes if it exits 0 (and trained, or printed the precision
table for `--dry_run`), or exits 2 with exactly one `mpt-train: error:` line;
a traceback fails it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any

import pytest
from launchers import launch_in_process
from replicas import on_two_cpus, run_on_two_cpus
from tiny_runs import manifest_file, small_model

# Its two-replica cases run in the two-CPU host (tests/replicas.py).
pytestmark = on_two_cpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The one rule, by class, of a manifest for any of the configs (its default: `_run_rows`).
GENERIC_RULE = {"match": {"class": "Dense"}, "policy": "mixed_bfloat16", "reason": "test"}
FLAGS = {
    "config": ("digits_cnn.json", "digits_mlp.json", "python_source_transformer.json"),
    # "manifest": --manifest instead of --precision. Not here, 3 training rows each: no flag
    # (the config's own, one of these; tests/test_reliability.py trains each bundled config in
    # it) and `auto` (one of these, by machine; tests/test_train_launcher.py).
    "precision": ("float32", "mixed_float16", "mixed_bfloat16", "manifest"),
    "jit_compile": ("auto", "true", "false"),
    "strategy": ("auto", "one_device", "mirrored"),
    "deterministic": (False, True),
    "auto_promote": (False, True),
    "canary_steps": (0, 2),
    "dry_run": (False, True),
}
# The flags whose every pair of values trains, not only dry-runs.
STEP_FLAGS = ("precision", "jit_compile", "strategy")
_TABLE = (
    ("digits_cnn.json", "float32", "false", "mirrored", True, True, 0, False),
    ("digits_cnn.json", "manifest", "true", "auto", True, False, 0, False),
    ("digits_cnn.json", "mixed_bfloat16", "true", "one_device", False, False, 0, False),
    ("digits_cnn.json", "mixed_float16", "auto", "auto", True, False, 0, False),
    ("digits_mlp.json", "float32", "auto", "auto", True, True, 2, False),
    ("digits_mlp.json", "manifest", "auto", "one_device", False, True, 0, False),
    ("digits_mlp.json", "mixed_bfloat16", "auto", "mirrored", True, False, 0, False),
    ("digits_mlp.json", "mixed_float16", "false", "one_device", False, False, 2, False),
    ("digits_mlp.json", "mixed_float16", "true", "mirrored", False, True, 0, False),
    ("python_source_transformer.json", "float32", "true", "one_device", False, False, 0, False),
    ("python_source_transformer.json", "manifest", "false", "mirrored", True, False, 0, False),
    ("python_source_transformer.json", "mixed_bfloat16", "false", "auto", False, True, 0, False),
    ("digits_cnn.json", "mixed_bfloat16", "true", "mirrored", False, True, 2, True),
    ("digits_mlp.json", "float32", "false", "one_device", True, True, 0, True),
    ("python_source_transformer.json", "manifest", "auto", "auto", False, False, 2, True),
    ("python_source_transformer.json", "mixed_float16", "false", "one_device", True, True, 0, True),
)
ROWS = [dict(zip(FLAGS, values)) for values in _TABLE]


def test_the_rows_cover_every_pair():
    for a, b in itertools.combinations(FLAGS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        assert seen == set(itertools.product(FLAGS[a], FLAGS[b])), (a, b)
    for a, b in itertools.combinations(STEP_FLAGS, 2):
        trained = {(row[a], row[b]) for row in ROWS if not row["dry_run"]}
        assert trained == set(itertools.product(FLAGS[a], FLAGS[b])), (a, b)


def _argv(row: dict[str, Any], model_dir: str, tfds_dir: str, manifest: str) -> list[str]:
    override = {
        "steps": 2,
        "checkpoint_every": 2,
        "eval_every": 2,
        "log_every": 1,
        "saved_model": False,  # Its export is no flag's (tests/test_runs_training.py).
        "data": {"data_dir": tfds_dir, "batch_size": 8, "eval_examples": 16},
    }
    # The flags are the point, not the width: a smaller step traces and compiles sooner.
    small = small_model(row["config"])
    override["model"] = small["model"]
    override["data"].update(small.get("data", {}))
    argv = [
        f"--config={os.path.join(REPO, 'configs', row['config'])}",
        f"--model_dir={model_dir}",
        f"--config_override={json.dumps(override)}",
        f"--jit_compile={row['jit_compile']}",
        f"--strategy={row['strategy']}",
        f"--canary_steps={row['canary_steps']}",
    ]
    if row["precision"] == "manifest":
        argv.append(f"--manifest={manifest}")
    else:
        argv.append(f"--precision={row['precision']}")
    for name in ("deterministic", "auto_promote", "dry_run"):
        if row[name]:
            argv.append(f"--{name}")
    return argv


def _run_rows(tfds_dir: str, work_dir: str) -> list[dict[str, Any]]:
    """Runs every row (in the two-CPU host, see the module docstring)."""
    manifest = manifest_file(os.path.join(work_dir, "manifest.json"), "mixed_float16", GENERIC_RULE)
    results = []
    for i, row in enumerate(ROWS):
        model_dir = os.path.join(work_dir, f"run_{i}")
        launched = launch_in_process("mpt-train", *_argv(row, model_dir, tfds_dir, manifest))
        result = dataclasses.asdict(launched)
        result["trained"] = os.path.exists(os.path.join(model_dir, "metrics.json"))
        results.append(result)
    return results


@pytest.fixture(scope="module")
def outcomes(tfds_dir, tmp_path_factory) -> list[dict[str, Any]]:
    work_dir = str(tmp_path_factory.mktemp("flag_pairs"))
    return run_on_two_cpus("test_flag_pairs", "_run_rows", tfds_dir, work_dir, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ROWS)))
def test_each_row_trains_or_says_why_in_one_line(outcomes, index):
    row, outcome = ROWS[index], outcomes[index]
    described = f"{row}: status {outcome['status']}\n{outcome['stderr'][-3000:]}"
    assert "Traceback" not in outcome["stderr"], described
    if outcome["status"] == 0:
        if row["dry_run"]:
            # The precision table, and nothing trained.
            header = outcome["stdout"].splitlines()[0].split()
            assert header == ["path", "class", "policy", "decided_by"], described
            assert not outcome["trained"], described
        else:
            assert outcome["trained"], described
        return
    assert outcome["status"] == 2, described
    errors = [line for line in outcome["stderr"].splitlines() if line.startswith("mpt-train:")]
    assert len(errors) == 1 and errors[0].startswith("mpt-train: error: "), described

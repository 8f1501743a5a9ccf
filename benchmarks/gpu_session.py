"""Everything issue 34 measures on a lent GPU, as one command inside one time budget.

    python -m benchmarks.gpu_session [--small] [--budget_s=420] [--only=mlp,...] --output=DIR

A lent GPU gives a session 15 minutes, a machine's start and any rerun included, so the
float8 measurements run as one prepared command: each step a child process (its own XLA
flags, its own device memory), most important first, each given at most its cap and what is
left of `--budget_s`. A step that fails or runs out of time is recorded in one line and loses
no other; one that finds too little time left is not started. The benchmarks write their
files after each variant or cell, so a step stopped midway keeps what it measured.
`--only` reruns chosen steps. `--small` is the CPU dry run: every step at its `--small`, but for
the cuBLAS and smaller-width MLP steps, which at `--small` would run the `mlp` step again. Its
steps have no caps, only the budget: the caps are a GPU's pace, and a CPU's (a loaded one's
above all) tells nothing about them; the dry run checks the commands, not their time.

Each step writes into `<output>/<step>/`; the session's record, `<output>/gpu_session_<date>.json`
(each step's command, seconds, outcome, files and last lines of output), sits beside them:
at most 8 files in all, as many as a lent machine sends back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A step given less than this is not started: it could not even compile its first program.
MIN_STEP_S = 20
TAIL_LINES = 40
# The first run's: the two goals' steps fit in it, then what else does; with a machine's start
# it leaves a lent session's 15 minutes room for a rerun of the rest (`--only`).
BUDGET_S = 420
VALIDATE = (
    "-m", "trainers.validate", "--backend=jax",
    "--config=configs/python_source_transformer.json",
    "--manifest=configs/manifests/python_source_transformer_float8.json",
)  # fmt: skip
# The dry run's `validate`: two steps of a 1-block Transformer, evaluated on 64 sequences of 8
# tokens. It checks the command, not the gate; on a CPU each compile costs, not the width.
VALIDATE_SMALL = (
    "--steps=2",
    '--config_override={"model": {"options": {"num_layers": 1, "d_model": 16, "num_heads": 2}},'
    ' "data": {"sequence_length": 8, "eval_examples": 64}}',
)


@dataclasses.dataclass(frozen=True)
class Step:
    """One child process: `python <args> ` with `{output}` filled by the step's folder."""

    name: str
    args: tuple[str, ...]
    cap_s: int | None  # None: what is left of the budget (the dry run's steps).
    xla_flags: str = ""  # Added to XLA_FLAGS (read once per process: hence a child each).
    drop: tuple[str, ...] = ()  # What the step writes that is not sent back (files, folders).


def plan(small: bool) -> tuple[Step, ...]:
    """The steps, most important first: the issue's two speed goals (float8 at least 1.3x
    bfloat16 on the MLP blocks at width 4096; at least bfloat16's speed on the reference
    Transformer), each with the census of the compiled step; then cuBLAS's float8 GEMMs
    (XLA's Triton GEMMs off), `mpt-validate` of the float8 manifest, and smaller widths; the
    dry run leaves out the steps that at `--small` would repeat the `mlp` step."""
    dry = ("--small",) if small else ()

    def cap(seconds: int) -> int | None:
        return None if small else seconds

    mlp = ("-m", "benchmarks.float8_mlp", *dry, "--output={output}")
    # At `--small`, these would run the `mlp` step's command again (on a CPU, XLA's GPU flag
    # changes nothing).
    cublas = () if small else (
        Step("mlp_cublas", mlp, 90, xla_flags="--xla_gpu_enable_triton_gemm=false"),
    )  # fmt: skip
    widths = () if small else (
        Step("mlp_2048", (*mlp, "--width=2048"), 60),
        Step("mlp_768", (*mlp, "--width=768"), 45),
    )  # fmt: skip
    return (
        Step("mlp", mlp, cap(150)),
        Step(
            "transformer",
            (
                "-m",
                "benchmarks.gpu_check",
                *dry,
                "--per_cell_processes",
                "--precisions=mixed_bfloat16,float8",
                "--stacks=ours",
                "--output={output}",
            ),
            cap(200),  # Two processes, each compiling (and autotuning) a 92M-parameter step twice.
        ),
        *cublas,
        Step(
            "validate",
            (*VALIDATE, *(VALIDATE_SMALL if small else ()), "--output={output}/lm_float8.json"),
            cap(90),
            drop=("lm_float8.png", "lm_float8_logs"),  # The chart, TensorBoard's curves.
        ),
        *widths,
    )


def run_step(step: Step, folder: str, seconds: float, env: Mapping[str, str]) -> dict[str, Any]:
    """Runs `step` for at most `seconds`, its whole process group stopped after; its record."""
    os.makedirs(folder, exist_ok=True)
    argv = [sys.executable, *(arg.replace("{output}", folder) for arg in step.args)]
    env = dict(env)
    if step.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {step.xla_flags}".strip()
    started = time.monotonic()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        child = subprocess.Popen(
            argv, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = child.wait(timeout=seconds)
            outcome = "ok" if code == 0 else f"failed: exit status {code}"
        except subprocess.TimeoutExpired:
            outcome = f"stopped: out of time after {seconds:.0f} s"
        finally:  # Its children too: a benchmark's cell processes hold the device.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        log.seek(0)
        tail = log.read().splitlines()[-TAIL_LINES:]
    for name in step.drop:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    return {
        "step": step.name,
        "command": shlex.join(["python", *argv[1:]]),
        "xla_flags": step.xla_flags or None,
        "seconds": round(time.monotonic() - started, 1),
        "outcome": outcome,
        "files": sorted(os.listdir(folder)),
        "output_tail": tail,
    }


def run_session(
    steps: Sequence[Step], output: str, budget_s: float, env: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Each step in order within `budget_s` all told; a record for every step, run or not."""
    deadline = time.monotonic() + budget_s
    records = []
    for step in steps:
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            records.append({"step": step.name, "outcome": f"not started: {int(left)} s left"})
            continue
        folder = os.path.join(output, step.name)
        cap_s = left if step.cap_s is None else min(step.cap_s, left)
        records.append(run_step(step, folder, cap_s, env))
        print(f"{step.name}: {records[-1]['outcome']} ({records[-1]['seconds']} s)", flush=True)
    return records


def _gpus() -> list[str]:
    """nvidia-smi's name, driver and memory of each GPU; none without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, check=False, timeout=30)
    return done.stdout.strip().splitlines()


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined when it runs (not on import: the suite imports this module
    beside benchmarks that define some of the same names)."""
    flags.DEFINE_bool("small", False, "The CPU dry run: every step at its --small.")
    flags.DEFINE_float(
        "budget_s", BUDGET_S, "Seconds for all steps together.", lower_bound=MIN_STEP_S
    )
    flags.DEFINE_list("only", None, "Only these steps (a rerun); default: all, in order.")
    flags.DEFINE_string("output", None, "The folder the steps' files and the record go to.")
    flags.mark_flag_as_required("output")


def main(argv: Sequence[str]) -> None:
    from mpt_keras.checks import refusal

    steps = plan(FLAGS.small)
    names = [step.name for step in steps]
    unknown = [name for name in FLAGS.only or () if name not in names]
    if unknown:
        raise app.UsageError(str(refusal("--only", ",".join(unknown), ", ".join(names))))
    chosen = [step for step in steps if not FLAGS.only or step.name in FLAGS.only]
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONUNBUFFERED": "1"}
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    records = run_session(chosen, FLAGS.output, FLAGS.budget_s, env)
    record = {
        "benchmark": "gpu_session",
        "date": started,
        "command": shlex.join(["python", "-m", "benchmarks.gpu_session", *sys.argv[1:]]),
        "gpus": _gpus(),
        "budget_s": FLAGS.budget_s,
        "steps": records,
    }
    path = os.path.join(FLAGS.output, f"gpu_session_{started[:10]}.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)

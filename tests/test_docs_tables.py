"""The tables of docs/benchmarks.md are made from their result files, and checked against them.

Hand-made results pin the exact markdown; the committed page is checked
against the committed result files; nothing is measured.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest

from benchmarks import ablation_table, docs_tables, result_files
from mpt_keras.errors import UserInputError
from mpt_keras.precision import hardware

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINE = {
    "cpu": "AMD EPYC",
    "cpu_count": 2,
    "cpu_flags": [],
    "tensorflow": "2.21.0",
    "keras": "3.15.1",
    "devices": ["/device:CPU:0"],
}
AVX2 = "AMD EPYC, 2 cores, CPU flags avx avx2 fma (no bfloat16 or float16 arithmetic)"


def _run(date: str, command: str, cpu_flags=("avx", "avx2", "fma")) -> dict:
    return {"date": date, "command": command, "cpu_flags": list(cpu_flags)}


def _suite_variant(step_ms: float, memory_bytes: int, vs_stock: dict | None) -> dict:
    return {
        "compute_dtype": "float32",
        "median_step_seconds": step_ms / 1e3,
        "examples_per_second": 64 / (step_ms / 1e3),
        "tokens_per_second": None,
        "flops_per_second": 4e9 / step_ms,
        "fraction_of_matmul_peak": 0.04 / step_ms,
        "peak_memory_bytes": memory_bytes,
        "speed": {"vs_float32": None, "vs_stock": vs_stock, "vs_no_xla": None},
        "op_profile": None,
    }


BENCH = {
    "benchmark": "suite",
    "machine": MACHINE,
    "run": _run(
        "2026-11-25T08:00:00+00:00",
        "mpt-bench --models=mlp --precisions=float32 --xla=off --output=/tmp/b",
    ),
    "matmul_peak": {
        "size": 64,
        "rounds": 2,
        "flops_per_second": {"float32": 1e11, "bfloat16": 2e11, "float16": 5e10},
    },
    "variants": {
        "mlp/float32/xla_off/ours": _suite_variant(
            2.0, 2**20, {"ratio": 0.8, "paired_ratio_median": 0.81}
        ),
        "mlp/float32/xla_off/stock": _suite_variant(1.6, 2**19, None),
    },
    "auto_jit_compile": {"mlp/float32": {"jit_compile": False, "step_time_over_best": None}},
}
BENCH_SECTION = f"""
Measured 2026-11-25 on {AVX2}, TensorFlow 2.21.0, Keras 3.15.1, by \
`mpt-bench --models=mlp --precisions=float32 --xla=off --output=/tmp/b`:

```
variant                    step ms     ex/s    tok/s  GFLOP/s  %peak  mem MiB  /f32 (ceil) /stock /noXLA
mlp/float32/xla_off/ours      2.00    32000        -     2.00   2.0%      1.0     - (1.00)   0.80      -
mlp/float32/xla_off/stock     1.60    40000        -     2.50   2.5%      0.5     - (1.00)      -      -
ratios: examples/s over float32 (ceiling: the dtype's matmul peak over float32's), over stock, \
over XLA off; above 1 faster
matmul peak (64x64, median of 2 rounds): float32 100.0 GFLOP/s (1.00x), \
bfloat16 200.0 GFLOP/s (2.00x), float16 50.0 GFLOP/s (0.50x)
jit_compile=auto mlp/float32: XLA off; not compared (needs --xla=off,on)
machine: AMD EPYC, 2 cores, flags none; TensorFlow 2.21.0, Keras 3.15.1
```
"""  # noqa: E501 (mpt-bench's table is 104 characters wide)
VARIANTS = ["stock", "+train_step", "+loss_scale_optimizer", "+manifest", "+monitor"]


def _cell(model: str, precision: str, xla: bool, stock_ms: float, ratios: list, date: str):
    """A cell whose variants step `ratios[i]` times the one before (ratios as paired medians)."""
    seconds = {"stock": stock_ms / 1e3}
    for (previous, name), ratio in zip(zip(VARIANTS, VARIANTS[1:]), ratios, strict=True):
        seconds[name] = seconds[previous] * ratio
    xla_flag = "on" if xla else "off"
    return {
        "benchmark": "stack_ablation",
        "model": model,
        "precision": precision,
        "xla": xla,
        "median_step_seconds": seconds,
        "vs_stock": {
            name: {"ratio": 0.0, "paired_ratio_median": seconds[name] / seconds["stock"]}
            for name in VARIANTS[1:]
        },
        "vs_previous": {
            name: {"ratio": 0.0, "paired_ratio_median": ratio}
            for name, ratio in zip(VARIANTS[1:], ratios, strict=True)
        },
        "machine": MACHINE,
        "run": _run(
            date,
            f"python -m benchmarks.stack_ablation --model={model} --precision={precision} "
            f"--xla={xla_flag} --rounds=30 --add_to=benchmarks/results/stack_ablation.json",
        ),
    }


CELLS = [
    _cell("mlp", "float32", False, 0.5, [0.8, 1.25, 1.0, 1.05], "2026-11-25T08:00:00+00:00"),
    _cell("mlp", "float32", True, 3.0, [1.0, 1.0, 1.0, 1.02], "2026-11-26T09:30:00+00:00"),
    _cell("cnn", "mixed_float16", False, 4.0, [0.5, 2.0, 1.0, 1.0], "2026-11-25T08:10:00+00:00"),
]
ABLATION_SECTION = f"""
Measured 2026-11-25 to 2026-11-26 on {AVX2}, TensorFlow 2.21.0, Keras 3.15.1, one process per \
row, by:

```bash
python -m benchmarks.stack_ablation --model=mlp --precision=float32 --xla=off --rounds=30 \
--add_to=benchmarks/results/stack_ablation.json
python -m benchmarks.stack_ablation --model=mlp --precision=float32 --xla=on --rounds=30 \
--add_to=benchmarks/results/stack_ablation.json
python -m benchmarks.stack_ablation --model=cnn --precision=mixed_float16 --xla=off --rounds=30 \
--add_to=benchmarks/results/stack_ablation.json
```

| model | precision | XLA | stock ms | ours ms | ours / stock | `+train_step` | \
`+loss_scale_optimizer` | `+manifest` | `+monitor` |
|---|---|---|---:|---:|---:|---:|---:|---:|---:|
| mlp | float32 | off | 0.50 | 0.53 | 1.050 | 0.800 | 1.250 | 1.000 | 1.050 |
| mlp | float32 | on | 3.00 | 3.06 | 1.020 | 1.000 | 1.000 | 1.000 | 1.020 |
| cnn | mixed_float16 | off | 4.00 | 4.00 | 1.000 | 0.500 | 2.000 | 1.000 | 1.000 |

ms: median step time. ours / stock: `+monitor` (every piece: `mpt-bench`'s `ours`) over stock; \
`+<piece>`: the variant that adds it over the one before (stock for `+train_step`). Step-time \
ratios, medians of the per-round ratios; below 1: faster.

ours / stock by model: mlp 1.020-1.050, cnn 1.000; at most 1.03 (the goal) in 2 of 3 cells.
"""


def _page(*sources: str) -> str:
    """A page with a stale section per result file, between prose."""
    sections = [
        f"{docs_tables.begin_marker(source)}\nstale\n{docs_tables.END}\n" for source in sources
    ]
    return "# Benchmarks\n\n" + "\nprose\n\n".join(sections) + "\nthe end\n"


def _write(root, source: str, result) -> None:
    path = root / source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def test_the_committed_page_matches_the_committed_result_files():
    with open(os.path.join(REPO, docs_tables.DOC), encoding="utf-8") as file:
        text = file.read()
    sources = [source for source, _, _ in docs_tables.sections(text.split("\n"), docs_tables.DOC)]
    assert sources == [
        "benchmarks/results/bench_float8.json",
        "benchmarks/results/bench.json",
        "benchmarks/results/stack_ablation.json",
        "benchmarks/results/gpu_2026-11-27_cpu.json",
        "benchmarks/results/float8_census_2026-12-04_h100.json",
    ]
    assert docs_tables.regenerate(text, REPO) == (text, [])


def test_a_bench_json_becomes_mpt_benchs_table_under_its_date_machine_and_command(tmp_path):
    _write(tmp_path, "results/bench.json", BENCH)
    text, changed = docs_tables.regenerate(_page("results/bench.json"), str(tmp_path))
    assert changed == ["results/bench.json"]
    begin = docs_tables.begin_marker("results/bench.json")
    assert text == f"# Benchmarks\n\n{begin}\n{BENCH_SECTION}\n{docs_tables.END}\n\nthe end\n"
    assert docs_tables.regenerate(text, str(tmp_path)) == (text, [])


def test_ablation_cells_become_one_row_each_under_their_dates_machine_and_commands(tmp_path):
    _write(tmp_path, "results/ablation.json", {"benchmark": "stack_ablation", "cells": CELLS})
    text, changed = docs_tables.regenerate(_page("results/ablation.json"), str(tmp_path))
    assert changed == ["results/ablation.json"]
    begin = docs_tables.begin_marker("results/ablation.json")
    assert text == f"# Benchmarks\n\n{begin}\n{ABLATION_SECTION}\n{docs_tables.END}\n\nthe end\n"


def test_a_result_file_not_measured_yet_is_said_so_and_the_prose_is_kept(tmp_path):
    _write(tmp_path, "results/bench.json", BENCH)
    page = _page("results/absent.json", "results/bench.json")
    text, changed = docs_tables.regenerate(page, str(tmp_path))
    assert changed == ["results/absent.json", "results/bench.json"]
    assert text.startswith(
        f"# Benchmarks\n\n{docs_tables.begin_marker('results/absent.json')}\n\n"
        f"*Not measured yet: `results/absent.json` does not exist.*\n\n{docs_tables.END}\n"
        f"\nprose\n\n{docs_tables.begin_marker('results/bench.json')}\n"
    )
    assert text.endswith(f"{docs_tables.END}\n\nthe end\n")


def test_check_names_the_stale_result_files_on_one_line_and_exits_1(tmp_path):
    _write(tmp_path, "benchmarks/results/bench.json", BENCH)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(_page("benchmarks/results/bench.json"))
    command = [sys.executable, "-m", "benchmarks.docs_tables"]

    def run(*flags):
        return subprocess.run(
            [*command, *flags], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    stale = run("--check")
    assert (stale.returncode, stale.stdout) == (1, "")
    assert stale.stderr == (
        "docs/benchmarks.md: out of date with benchmarks/results/bench.json. "
        "Run: python -m benchmarks.docs_tables\n"
    )
    written = run()
    assert (written.returncode, written.stderr) == (0, "")
    assert written.stdout == (
        "docs/benchmarks.md: rewrote the sections from benchmarks/results/bench.json\n"
    )
    assert run("--check").returncode == 0


@pytest.mark.parametrize(
    "page, message",
    [
        ("# Benchmarks\n", "page.md: no generated sections. Allowed: '<!-- generated by"),
        (
            f"{docs_tables.begin_marker('a.json')}\n\n",
            "page.md:1: the section from a.json has no '<!-- end generated -->' line",
        ),
        (
            f"{docs_tables.begin_marker('a.json')}\n{docs_tables.begin_marker('b.json')}\n",
            "page.md:2: a section begins inside the one from a.json (line 1). "
            "Allowed: '<!-- end generated -->' first",
        ),
        (f"x\n{docs_tables.END}\n", "page.md:2: '<!-- end generated -->' without a section begun"),
        (
            "<!-- generated by hand from a.json -->\n",
            "page.md:1: received marker '<!-- generated by hand from a.json -->'. "
            "Allowed: '<!-- generated by python -m benchmarks.docs_tables from <result file>: "
            "do not edit -->'",
        ),
    ],
)
def test_a_bad_marker_is_named_with_its_line(page, message, tmp_path):
    with pytest.raises(UserInputError) as raised:
        docs_tables.regenerate(page, str(tmp_path), "page.md")
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    "result, message",
    [
        (
            {key: value for key, value in BENCH.items() if key != "run"},
            "r.json: no 'run' record (date, command, CPU flags). Allowed: a result written by "
            "mpt-bench --output, python -m benchmarks.stack_ablation --add_to or "
            "python -m benchmarks.gpu_check",
        ),
        (
            {"benchmark": "matmul"},
            "r.json: received benchmark 'matmul'. Allowed: a result of benchmark 'suite' or "
            "'stack_ablation' or 'gpu_check' or 'float8_census'",
        ),
        (
            [BENCH],
            "r.json: received a JSON list. Allowed: a result of benchmark 'suite' or "
            "'stack_ablation' or 'gpu_check' or 'float8_census'",
        ),
        (
            {"benchmark": "stack_ablation", "cells": [CELLS[0], CELLS[1], CELLS[0]]},
            "r.json: cell mlp/float32/xla_off measured twice. Allowed: each cell once",
        ),
        (
            {"benchmark": "stack_ablation", "cells": []},
            "r.json: received no cells. Allowed: one or more",
        ),
        (
            CELLS[0],
            "r.json: received a result without 'cells' (as --output writes one run's). Allowed: a "
            'stack ablation results file ({"benchmark": "stack_ablation", "cells": [...]}, as '
            "--add_to writes it)",
        ),
        (
            {
                "benchmark": "stack_ablation",
                "cells": [
                    CELLS[0],
                    {**CELLS[1], "run": {**CELLS[1]["run"], "cpu_flags": ["avx512_bf16"]}},
                ],
            },
            f"r.json: measured on 2 machines: {AVX2}, TensorFlow 2.21.0, Keras 3.15.1; "
            "AMD EPYC, 2 cores, CPU flags avx512_bf16, TensorFlow 2.21.0, Keras 3.15.1. Allowed: "
            "one machine per table (measure every cell there, or start a new results file)",
        ),
        (
            {
                "benchmark": "stack_ablation",
                "cells": [
                    CELLS[0],
                    {
                        **CELLS[1],
                        "median_step_seconds": {"stock": 1.0, "+train_step": 1.0},
                    },
                ],
            },
            "r.json: cell mlp/float32/xla_on measured the variants ['stock', '+train_step'], "
            f"cell mlp/float32/xla_off {VARIANTS}. Allowed: the same in every cell (measure the "
            "older cells again)",
        ),
    ],
)
def test_a_result_a_table_cannot_be_made_of_is_one_line_naming_the_file(result, message):
    with pytest.raises(UserInputError) as raised:
        docs_tables.section_lines("r.json", result)
    assert str(raised.value) == message


def test_a_result_file_that_is_not_json_is_named(tmp_path):
    (tmp_path / "r.json").write_text('{"benchmark": ')
    with pytest.raises(UserInputError) as raised:
        result_files.read(str(tmp_path / "r.json"))
    assert str(raised.value) == f"{tmp_path / 'r.json'}: not JSON (Expecting value, line 1)"


def test_add_cell_replaces_a_cells_earlier_measurement_in_place_and_appends_a_new_one(tmp_path):
    path = str(tmp_path / "results" / "ablation.json")
    for cell in CELLS:
        ablation_table.add_cell(path, cell)
    again = {**CELLS[0], "run": _run("2026-11-27T00:00:00+00:00", "again")}
    ablation_table.add_cell(path, again)
    with open(path, encoding="utf-8") as file:
        written = json.load(file)
    assert written == {"benchmark": "stack_ablation", "cells": [again, CELLS[1], CELLS[2]]}
    assert ablation_table.load_cells(path) == [again, CELLS[1], CELLS[2]]
    assert ablation_table.load_cells(str(tmp_path / "absent.json")) == []


def test_the_run_record_holds_the_date_the_quoted_command_and_the_vector_flags(monkeypatch):
    probe = hardware.HardwareProbe(cpu_flags=frozenset({"sse2", "avx512_bf16", "fma", "avx2"}))
    # The machine's own flags, not those `auto` may be told to read (MPT_KERAS_CPUINFO).
    monkeypatch.setattr(hardware, "probe_hardware", {hardware.PROC_CPUINFO: probe}.__getitem__)
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    run = result_files.record(["python", "-m", "benchmarks.stack_ablation", "--add_to=a b.json"])
    assert run["command"] == "python -m benchmarks.stack_ablation '--add_to=a b.json'"
    assert run["cpu_flags"] == ["avx2", "fma", "avx512_bf16"]  # In CPU_FLAGS' order.
    date = datetime.datetime.fromisoformat(run["date"])
    assert date.tzinfo == datetime.UTC
    assert before <= date <= datetime.datetime.now(datetime.UTC)


def test_stamp_adds_the_run_record_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(result_files, "record", lambda command: {"command": " ".join(command)})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"benchmark": "suite", "variants": {}}))
    result_files.stamp(str(path), ["mpt-bench", "--rounds=2"])
    assert json.loads(path.read_text()) == {
        "benchmark": "suite",
        "variants": {},
        "run": {"command": "mpt-bench --rounds=2"},
    }

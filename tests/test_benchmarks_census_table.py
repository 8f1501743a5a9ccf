"""benchmarks/census_table.py: the table docs/benchmarks.md shows of a float8 census result,
made through docs_tables as the page's other tables; a hand-made result pins its markdown."""

import json

import pytest

from benchmarks import census_table, docs_tables
from mpt_keras.errors import UserInputError

MACHINE = {
    "cpu": "AMD EPYC",
    "cpu_count": 2,
    "devices": ["/device:CPU:0"],
    "jax": "0.10.2",
    "keras": "3.15.1",
}
AVX2 = "AMD EPYC, 2 cores, CPU flags avx avx2 fma (no bfloat16 or float16 arithmetic)"
CENSUS_GEMMS = [
    {"layer": "block_0_up", "gemm": "forward", "runs_in": "float8", "kernel": "triton gemm",
     "verdict": "float8"},
    {"layer": "block_0_up", "gemm": "weight gradient", "runs_in": "bfloat16",
     "kernel": "triton gemm", "verdict": "fallback"},
]  # fmt: skip
CENSUS = {
    "benchmark": "float8_census",
    "target": "h100",
    "rows": [
        {
            "model": "mlp",
            "shape": {"width": 4096, "blocks": 2, "sequences": 8, "tokens": 1024},
            "variant": "float8 delayed",
            "triton_gemms": True,
            "census": {"gemms": CENSUS_GEMMS},
        },
        {"model": "transformer", "variant": "float8 keras", "triton_gemms": False,
         "error": "needs JAX's CUDA plugin"},
    ],  # fmt: skip
    "machine": MACHINE,
    "run": {"date": "2026-12-04T20:00:00+00:00", "command": "python -m benchmarks.float8_census",
            "cpu_flags": ["avx", "avx2", "fma"]},
}  # fmt: skip


def test_a_census_result_becomes_one_row_per_cell_with_its_kernels_counted(tmp_path):
    (tmp_path / "census.json").write_text(json.dumps(CENSUS))
    page = f"{docs_tables.begin_marker('census.json')}\nstale\n{docs_tables.END}\n"
    text, changed = docs_tables.regenerate(page, str(tmp_path))
    assert changed == ["census.json"]
    section = text.split(docs_tables.begin_marker("census.json"))[1]
    assert section.split(docs_tables.END)[0].splitlines()[2:] == [
        f"Measured 2026-12-04 on {AVX2}, JAX 0.10.2, Keras 3.15.1, by "
        "`python -m benchmarks.float8_census`:",
        "",
        "Each train step compiled for an H100 on this machine, no GPU present (XLA's GPU "
        "compiler, before autotuning), never run.",
        "",
        "| model | float8 layers | XLA's Triton GEMMs | GEMMs in float8 | what XLA made of them |",
        "|---|---|---|---:|---|",
        "| MLP, 2 blocks of width 4096, 8 x 1024 tokens | ours, delayed scaling | on (default) | "
        "1 of 2 | 1 `triton gemm` in float8, 1 `triton gemm` in bfloat16 |",
        "| transformer | Keras' own (`quantize`) | off | | not compiled: needs JAX's CUDA plugin |",
        "",
    ]


def test_a_census_result_without_rows_is_one_line_naming_the_file():
    with pytest.raises(UserInputError) as raised:
        census_table.markdown_table({"benchmark": "float8_census", "rows": []}, "r.json")
    assert str(raised.value) == "r.json: received no rows. Allowed: a float8_census result"

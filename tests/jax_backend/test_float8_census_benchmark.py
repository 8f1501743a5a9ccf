"""benchmarks/float8_census.py's dry run (`--small`), in this process with XLA's Triton GEMMs
on: both models compiled for an H100 on this CPU; Keras' float8 runs no GEMM in float8 there,
ours every one. The Triton-off cells (a child process) are left to the benchmark's own run."""

from benchmarks.float8_census import CELLS, cells_here


def test_each_cell_compiled_for_an_h100_says_how_many_gemms_run_in_float8():
    rows = cells_here(small=True, target="h100", triton_gemms=True)
    assert [(row["model"], row["variant"]) for row in rows] == list(CELLS)
    summaries = [row.get("error") or row["census"]["summary"].split(" (")[0] for row in rows]
    assert summaries == [
        "fallback: 0 of 6 GEMMs of 2 float8 layers run in float8",
        "float8: 6 of 6 GEMMs of 2 float8 layers run in float8",
        "float8: 6 of 6 GEMMs of 2 float8 layers run in float8",
        "fallback: 0 of 18 GEMMs of 6 float8 layers run in float8",
        "float8: 18 of 18 GEMMs of 6 float8 layers run in float8",
    ]

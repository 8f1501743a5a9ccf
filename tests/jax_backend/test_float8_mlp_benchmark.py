"""The float8 MLP benchmark's CPU dry run, on JAX as on the GPU machines: every variant
trains, and each float8 variant's census finds its 6 GEMMs (1 block x 2 Dense x 3), all
emulated here. Its timings are this CPU's and are not checked."""

import os
import subprocess
import sys

from benchmarks.float8_mlp import VARIANTS, run
from benchmarks.float8_models import MLP_SMALL as SMALL

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_variant_trains_and_the_float8_ones_take_their_census():
    seen = []
    result = run(SMALL, steps=1, measured=lambda so_far: seen.append(len(so_far["rows"])))
    assert seen == [1, 2, 3, 4]  # The file is written again after each variant.
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == list(VARIANTS)
    assert [row.get("error") for row in rows.values()] == [None] * 4
    assert rows["bfloat16"]["speed_over_bfloat16"] == 1.0
    assert rows["bfloat16"]["float8_census"] is None
    for variant in ("float8 keras", "float8 delayed", "float8 current"):
        assert rows[variant]["census_summary"] == (
            "emulated: 0 of 6 GEMMs of 2 float8 layers run in float8 "
            "(no GPU: this machine has no float8 matmul units)"
        )
        assert rows[variant]["speed_over_bfloat16"] > 0


def test_a_width_beside_small_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.float8_mlp", "--small", "--width=64"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--width: not with --small (its width is 32). Allowed: one of them" in done.stderr

"""Tests of mpt_keras.tables: aligned text columns."""

from mpt_keras.tables import aligned


def test_columns_are_as_wide_as_their_widest_cell_without_trailing_spaces():
    rows = [("layer", "policy", "why"), ("dense_1", "float32", ""), ("d", "mixed_float16", "x")]
    assert aligned(rows, indent="  ") == [
        "  layer    policy         why",
        "  dense_1  float32",
        "  d        mixed_float16  x",
    ]


def test_no_rows_give_no_lines():
    assert aligned([]) == []

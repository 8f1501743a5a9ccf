"""Validation: a candidate precision against float32, layer by layer and metric by metric.

thresholds.py      Thresholds: what a candidate must meet, and each Check
forward_parity.py  each layer's output in the candidate against float32's
parity_rows.py     which calls forward parity compares, and what feeds each
report.py          ValidationReport: checks and parity rows, as a table and JSON
loss_curves.py     the two loss curves as a PNG and TensorBoard scalars
"""

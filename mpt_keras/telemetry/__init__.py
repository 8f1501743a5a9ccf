"""Telemetry: what a run shows while it trains.

monitor.py      MixedPrecisionMonitor: TensorBoard summaries and Keras logs
layout.py       the tag names and their TensorBoard custom-scalars dashboard
metrics_csv.py  MetricsCsv: `model_dir/metrics.csv`
prometheus.py   PrometheusExporter: `mpt-train --metrics_port`
diagnosis.py    diagnose_nonfinite: the first layer or gradient that went non-finite
"""

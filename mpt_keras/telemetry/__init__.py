"""Telemetry: what a run shows while it trains.

monitor.py            MixedPrecisionMonitor: TensorBoard summaries and Keras logs
summaries.py          the monitor's summary writers and its traced scalar writes
sample_statistics.py  activation and gradient magnitudes on a sample batch vs float16
overflow_report.py    the variables and layers an interval's overflows touched, in words
layout.py             the tag names and their TensorBoard custom-scalars dashboard
metrics_csv.py        MetricsCsv: `model_dir/metrics.csv`
prometheus.py         PrometheusExporter: `mpt-train --metrics_port`
diagnosis.py          diagnose_nonfinite: the first layer or gradient that went non-finite
"""

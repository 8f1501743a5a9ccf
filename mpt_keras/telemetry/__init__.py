"""Telemetry: what a run shows as it trains.

monitor.py            MixedPrecisionMonitor: TensorBoard summaries and Keras logs
event_files.py        the summary writers on JAX (TensorFlow's: backend/tensorflow/summaries.py)
optimizer_scalars.py  the optimizer's scalars and the overflow rate, beside the step logs
sample_statistics.py  sample-batch activation and gradient magnitudes vs float16
overflow_report.py    the variables and layers an interval's overflows touched
layout.py             the tag names and their TensorBoard dashboard
metrics_csv.py        MetricsCsv: `model_dir/metrics.csv`
prometheus.py         PrometheusExporter: `mpt-train --metrics_port`
diagnosis.py          diagnose_nonfinite: the first layer or gradient gone non-finite
"""

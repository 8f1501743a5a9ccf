"""Calibration: measure a model in float32 on real batches, then decide each layer's precision.

calibrate.py    calibrate: the passes and decisions, into a CalibrationResult
inputs.py       calibrate's model, loss and data, checked and batched
sites.py        the layers measured and decided, and which decide together
statistics.py   figures per layer and variable: activations, gradients, output errors
measurement.py  the gradient pass, each group's low-precision errors, the diagnosis
decisions.py    CalibrationThresholds, and a policy with a reason per layer or group
float8.py       what Keras' float8 would lose per Dense and EinsumDense, and its decision
rules.py        the manifest: exact-path rules matching their layer alone
result.py       CalibrationResult: statistics, their JSON and table, the manifest
"""

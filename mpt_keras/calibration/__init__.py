"""Calibration: measure a model in float32 on real batches, then decide each layer's precision.

calibrate.py    calibrate: the measuring passes and the decisions, into a CalibrationResult
inputs.py       calibrate's model, loss and data, checked and cut into batches
sites.py        which layers are measured and decided, and which decide together
statistics.py   the figures per layer and variable: activations, gradients, output errors
measurement.py  the gradient pass, each group's errors in low precision, the diagnosis
decisions.py    CalibrationThresholds, and a policy with a reason per layer or group
float8.py       what Keras' float8 would lose in each Dense and EinsumDense, and its decision
rules.py        the manifest from the decisions: exact-path rules that match their layer alone
result.py       CalibrationResult: the statistics, their JSON and table, the manifest
"""

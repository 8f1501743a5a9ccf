"""Calibration: measure a model in float32 on real batches, then decide each layer's precision.

calibrate.py  calibrate -> CalibrationResult, a manifest with a reason per layer
sites.py      which layers are measured and decided, and which decide together
float8.py     what Keras' float8 would lose in each Dense and EinsumDense
"""

"""Reliability: a run that goes wrong is stopped, rolled back or moved up, never lost.

guards.py        BadBatchLimit, DivergenceGuard, ScaledLearningRate; loss_scale_optimizer
auto_promote.py  AutoPromote: layers that keep overflowing move to a wider precision
array_checkpoints.py  ArrayCheckpointer: checkpoints as NumPy files, on any Keras backend
"""

"""Loss scaling: the optimizer that keeps float16 gradients finite, and what it reports.

optimizer.py     LossScaleOptimizer, a drop-in for Keras' own
settings.py      LossScaleSettings: the scaling settings, checked whole; no TensorFlow
health.py        StepHealth: what the last steps left behind, read in one sync
compile_hook.py  `model.compile` gives a model with float16 layers our optimizer
"""

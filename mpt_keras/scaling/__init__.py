"""Loss scaling: the optimizer that keeps float16 gradients finite, and what it reports.

optimizer.py      LossScaleOptimizer, a drop-in for Keras' own: its Keras API and state
settings.py       LossScaleSettings: the scaling settings, checked whole; no TensorFlow
step.py           one step: the replica's part, then one cross-replica write
step_record.py    StepRecord: what a replica hands the cross-replica write
verdict.py        finite, overflow or bad batch; the per-variable flags and gradient norm
scale_rule.py     how the scale moves: growth, backoff with hysteresis, floor, ceiling
accumulation.py   gradient accumulation over micro-batches
inner_update.py   the inner optimizer's update: run, undone on overflow, or skipped
cross_replica.py  the gradient all-reduce and the writes in the cross-replica context
hand_over.py      what a train step hands the optimizer before `apply`
readings.py       the optimizer's step logs and health record, read from its variables
health.py         StepHealth and the step-log keys; no TensorFlow
compile_hook.py   `model.compile` gives a model with float16 layers our optimizer
"""

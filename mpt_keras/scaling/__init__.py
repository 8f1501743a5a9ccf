"""Loss scaling: the optimizer that keeps float16 gradients finite, and what it reports.

optimizer.py      LossScaleOptimizer, a drop-in for Keras' own
settings.py       LossScaleSettings, checked whole; no TensorFlow
step.py           one step: the replica's part, then one cross-replica write
step_record.py    StepRecord: what a replica hands the cross-replica write
scale_rule.py     growth, backoff with hysteresis, bounds
accumulation.py   gradient accumulation over micro-batches
inner_update.py   the inner update: run, undone on overflow, or skipped
cross_replica.py  the gradient all-reduce and the cross-replica writes
hand_over.py      what a train step hands the optimizer before `apply`
readings.py       step logs and health, read from the optimizer's variables
health.py         StepHealth and the step-log keys; no TensorFlow
compile_hook.py   `model.compile` gives float16 models our optimizer
"""

"""Loss scaling: the optimizer that keeps float16 gradients finite, and what it reports.

optimizer.py         LossScaleOptimizer, a drop-in for Keras' own
settings.py          LossScaleSettings, checked whole; no TensorFlow
step.py              one step on TensorFlow: the replica's part, then one cross-replica write
step_record.py       StepRecord: what a replica hands the cross-replica write
stateless_step.py    one step as a function of values (JAX's `stateless_apply`)
jax_train_step.py    the train step a JAX model compiled with our optimizer runs
scale_rule.py        growth, backoff with hysteresis, bounds
accumulation.py      gradient accumulation over micro-batches
inner_update.py      the inner update: run, undone on overflow, or skipped
own_variables.py     the optimizer's own variables and the model variables it was built on
hand_over.py         what a train step hands the optimizer before `apply`, and whether it
                     scaled its loss at all
bad_batch_metrics.py a batch skipped as bad data counts in no loss or metric
readings.py          step logs and health, read from the optimizer's variables
health.py            StepHealth and the step-log keys; no TensorFlow
compile_hook.py      `model.compile` gives float16 models our optimizer

The all-reduce and the cross-replica writes are TensorFlow's: backend/tensorflow/cross_replica.py.
"""

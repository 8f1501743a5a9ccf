"""TensorFlow only: tf.distribute, the tf.function train step, tf.train checkpoints,
tf.summary, tf.data and TFDS.

distribute.py        strategies by name
tpu_connection.py    the `tpu` strategy's connection, with bounded waits
multi_worker.py      a `multi_worker` cluster: TF_CONFIG checked, a dead peer reported
distributed_fit.py   Keras' `fit` and `evaluate` under a strategy (across workers too)
workers.py           which worker writes files (`is_chief`, `worker_write_dir`)
tf_errors.py         TF error messages cut to their first sentence
values.py            dense, ragged and sparse tensors' values
train_function.py    the function `fit` calls per step
checkpoints.py       Checkpointer: checkpoints a rerun resumes from
summaries.py         TensorBoard summary writers, scalars written in one traced call
memory.py            peak device memory per interval
gradients.py         a loss's gradients through a traced GradientTape
devices.py           the accelerators, whether code is traced, a trace without running
datasets.py          a factory's tf.data splits: checked, batched, their dimensions
batches.py           deterministic, resumable batching of in-memory arrays in tf.data
loading.py           TFDS splits, offline, as numpy arrays or unbatched pairs
digits.py            the embedded dataset `mpt_digits` (TFDS builder)
python_source.py     the embedded dataset `mpt_python_source` (TFDS builder)
embedded_builder.py  the embedded builders' shared base
compiled.py          the train step's optimized XLA program (HLO text)
step_verdict.py      the loss-scaled step's verdict (finite, overflow, bad batch) and norm
"""

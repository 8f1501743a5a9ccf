"""TensorFlow only: tf.distribute, the tf.function train step, tf.train checkpoints.

distribute.py        strategies by name
tpu_connection.py    the `tpu` strategy's connection, with bounded waits
multi_worker.py      a `multi_worker` cluster: TF_CONFIG checked, a dead peer reported
multi_worker_fit.py  Keras' `fit` and `evaluate` made to run across workers
workers.py           which worker writes files (`is_chief`, `worker_write_dir`)
tf_errors.py         TensorFlow's error messages cut to their first sentence
values.py            the values of dense, ragged and sparse tensors
train_function.py    the function `fit` calls for each step
checkpoints.py       Checkpointer: checkpoints that a rerun resumes from
"""

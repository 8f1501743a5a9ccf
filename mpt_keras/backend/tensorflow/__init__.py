"""TensorFlow only: tf.distribute, the tf.function train step, tf.train checkpoints.

distribute.py      strategies by name, and which worker writes files
train_function.py  the function `fit` calls for each step
checkpoints.py     Checkpointer: checkpoints that a rerun resumes from
"""

"""What only one Keras backend can do, one folder per backend.

tensorflow/  tf.distribute strategies, the tf.function train step, tf.train checkpoints
"""

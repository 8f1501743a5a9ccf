"""What only one Keras backend can do, one folder per backend.

names.py     the backends and their strategy names, importable without any backend
current.py   which backend runs, and the few answers that depend on it
tensorflow/  tf.distribute strategies, the train step function, checkpoints
jax/         a JAX run's Keras distribution
"""

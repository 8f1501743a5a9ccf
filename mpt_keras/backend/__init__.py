"""What only one Keras backend can do, one folder per backend.

names.py     the strategy names, importable without any backend
tensorflow/  tf.distribute strategies, the train step function, checkpoints
"""

"""The strategy names each Keras backend serves; imports no backend, so a config checks them."""

# tf.distribute strategies by name (`backend.tensorflow.distribute`).
STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker", "tpu")

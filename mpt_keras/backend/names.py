"""The strategy names each backend serves; imports no backend, so a config can check them."""

# `backend.tensorflow.distribute`.
STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker", "tpu")

"""The backends, the strategy names each serves and the GPU targets; imports no backend, so a
config or a launcher's flags can check them before Keras is imported."""

from mpt_keras.checks import refusal
from mpt_keras.errors import UserInputError

# The Keras backends mpt_keras serves, its first first.
BACKENDS = ("tensorflow", "jax")

# Each backend's (`backend.tensorflow.distribute`, `backend.jax.distribution`).
STRATEGIES_ON = {
    "tensorflow": ("auto", "one_device", "mirrored", "multi_worker", "tpu"),
    "jax": ("auto", "one_device", "data_parallel"),
}
STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker", "tpu", "data_parallel")

# The GPUs a JAX program can be compiled for without one (`backend.jax.gpu_targets`).
GPU_TARGETS = ("h100", "h200")


def check_strategy(name: str, backend: str) -> None:
    """Refuses, in one line, a strategy that `backend` does not serve."""
    allowed = STRATEGIES_ON[backend]
    if name in allowed:
        return
    if name not in STRATEGIES:
        raise refusal("strategy", repr(name), ", ".join(allowed))
    kind = "TensorFlow's tf.distribute" if backend == "jax" else "Keras' JAX distribution"
    raise UserInputError(
        f"strategy: received {name!r}, {kind} strategy, not served on Keras backend {backend}. "
        f"Allowed on {backend}: {', '.join(allowed)}"
    )

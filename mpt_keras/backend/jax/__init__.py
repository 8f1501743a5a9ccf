"""What a run needs from JAX itself: its distribution over the local devices (`distribution.py`)
a loss's gradients through `jax.value_and_grad` (`gradients.py`), the accelerators and
tracing (`devices.py`), and the train step's optimized XLA program (`compiled.py`).

Everything else a JAX run uses is backend-neutral Keras (`keras.ops`, `keras.distribution`).
"""

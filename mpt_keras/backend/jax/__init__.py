"""What a run needs from JAX itself: its distribution over the local devices (`distribution.py`).

Everything else a JAX run uses is backend-neutral Keras (`keras.ops`, `keras.distribution`).
"""

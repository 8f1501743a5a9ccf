"""The float16 limits every float16 judgement uses; imports no TensorFlow."""

FLOAT16_MAX = 65504.0  # Larger overflows to inf.
FLOAT16_SMALLEST_NORMAL = 2.0**-14  # 6.1e-5: below it, precision is lost.
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24  # 6.0e-8: below it, a value flushes to 0.

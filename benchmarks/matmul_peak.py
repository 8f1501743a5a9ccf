"""The machine's limit: measured matmul FLOP/s per dtype, the ceiling of every variant.

A square matmul by TensorFlow's own kernel (without XLA), or on Keras' JAX backend by
XLA's (`jax.jit`), the dtypes timed interleaved (`harness.interleave`) so their ratio sees
one machine load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import harness
from mpt_keras.backend import current

DTYPES = ("float32", "bfloat16", "float16")


def measure_matmul_peak(
    size: int, rounds: int, dtypes: Sequence[str] = DTYPES, matmuls_per_round: int = 2
) -> dict[str, Any]:
    """Measures matmul FLOP/s per dtype of `size x size` matrices; returns the JSON-ready result.

    Returns:
        `size`, `rounds`, `kernel` (whose matmul), `flops_per_matmul`, `step_seconds` (per dtype and
        round, seconds per matmul), `flops_per_second` (per dtype, of the
        median) and `<dtype>_over_float32` for bfloat16 and float16.
    """
    runners = {dtype: _matmul_runner(dtype, size) for dtype in dtypes}
    for runner in runners.values():
        runner(1)  # Traces and warms the kernel up.
    step_seconds = harness.interleave(runners, rounds, matmuls_per_round)
    flops = 2 * size**3
    flops_per_second = {
        dtype: flops / statistics.median(seconds) for dtype, seconds in step_seconds.items()
    }
    result = {
        "size": size,
        "rounds": rounds,
        "kernel": "XLA (jax.jit)" if current.is_jax() else "TensorFlow's MatMul without XLA",
        "flops_per_matmul": flops,
        "step_seconds": step_seconds,
        "flops_per_second": flops_per_second,
    }
    for dtype in ("bfloat16", "float16"):
        if dtype in flops_per_second and "float32" in flops_per_second:
            result[f"{dtype}_over_float32"] = flops_per_second[dtype] / flops_per_second["float32"]
    return result


def _matmul_runner(dtype: str, size: int) -> Callable[[int], float]:
    product = _jax_product(dtype, size) if current.is_jax() else _tensorflow_product(dtype, size)

    def run(matmuls: int) -> float:
        start = time.perf_counter()
        for _ in range(matmuls):
            value = product()
        float(value)
        return time.perf_counter() - start

    return run


def _tensorflow_product(dtype: str, size: int) -> Callable[[], Any]:
    import tensorflow as tf

    matrix = tf.cast(tf.random.stateless_normal((size, size), seed=(0, 0)), dtype)

    @tf.function(jit_compile=False)
    def product() -> Any:
        # One element goes back to the host: the wait, without copying the product.
        return tf.matmul(matrix, matrix)[0, 0]

    return product


def _jax_product(dtype: str, size: int) -> Callable[[], Any]:
    import jax

    matrix = jax.random.normal(jax.random.key(0), (size, size)).astype(dtype)
    square = jax.jit(lambda operand: operand @ operand)  # An argument: nothing to fold.
    # One element goes back to the host: the wait, without copying the product. Sliced
    # outside the compiled product, which XLA could otherwise shrink to that element.
    return lambda: square(matrix)[0, 0]

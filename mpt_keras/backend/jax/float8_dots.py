"""A float8 matrix product handed to XLA as one: `dot_general` of the float8 values themselves.

XLA's GPU compiler makes a float8 GEMM only of a dot whose operands it still sees as float8.
Keras' form, a dot of dequantized operands (`convert(float8) * scale`), is taken first by XLA's
Triton GEMM fusion as a bfloat16 GEMM, and `simplify-fp-conversions` then drops the round trip
through float8 altogether: compiled for an H100 (jaxlib 0.10.2), none of two float8 Dense
layers' five GEMMs ran in float8, nor were their operands rounded to it. A dot of the float8
values stays a float8 GEMM: a Triton one, or cuBLASLt's `__cublas$lt$matmul$f8` where Triton
GEMMs are off (docs/precision.md, the census).
"""

from __future__ import annotations

from typing import Any

import jax


def float8_dot(lhs: Any, rhs: Any, contracting: tuple[int, int]) -> Any:
    """`lhs @ rhs` of two float8 matrices (e4m3 or e5m2, mixed) over their dimensions
    `contracting`, accumulated and returned in float32."""
    dimensions = (((contracting[0],), (contracting[1],)), ((), ()))
    return jax.lax.dot_general(lhs, rhs, dimensions, preferred_element_type="float32")

"""The names of the precision concept, each list in one place.

A precision is a Keras dtype policy name, or `auto` (`hardware.resolve_auto_policy`).
Imports no TensorFlow, so a bad name fails before it loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpt_keras.checks import check_choice

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")
# What `--precision` and a config's "precision" take: a policy, or `auto`.
PRECISIONS = (*POLICY_NAMES, "auto")
# The policies a calibration measures each layer in.
LOW_PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16")
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
# One step up the ladder: float16 -> bfloat16 (float32's exponent range) -> float32.
PROMOTIONS = {"mixed_float16": "mixed_bfloat16", "mixed_bfloat16": "float32"}
# A rule's only (Dense/EinsumDense matmuls): not a default nor a `--precision`.
FLOAT8 = "float8"
RULE_POLICIES = (*POLICY_NAMES, FLOAT8)
# Keras names a float8 layer's policy after the one it computes in otherwise.
FLOAT8_POLICY_PREFIX = "float8_from_"


def promoted_policy(name: str) -> str | None:
    """The policy one step up from a layer's effective policy `name` (float8 to the policy
    it computes in, then `PROMOTIONS`), or None at the top."""
    if name.startswith(FLOAT8_POLICY_PREFIX):
        return name.removeprefix(FLOAT8_POLICY_PREFIX)
    return PROMOTIONS.get(name)


def check_policy_name(
    name: str,
    source: str = "precision",
    allowed: tuple[str, ...] = POLICY_NAMES,
    show: Callable[[Any], str] = repr,
) -> str:
    """Returns `name` if it is one of `allowed`; else raises `UserInputError` naming
    `source` (a key, a flag) and the allowed names. `show` writes the name received
    (`checks.as_json` for a JSON file)."""
    return check_choice(source, name, allowed, show=show)

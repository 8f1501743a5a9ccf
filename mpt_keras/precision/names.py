"""The names of the precision concept, each list in one place; imports no TensorFlow.

A precision is a Keras dtype policy name: `float32`, or `mixed_float16` and
`mixed_bfloat16`, which compute in the low-precision type and keep float32
variables. The config, the launchers' `--precision` flag and validation's
candidate also take `auto`, which `hardware.resolve_auto_policy` turns into
one of them. So a bad name fails before TensorFlow is imported
(`mpt_keras.config` checks its names here).

Example:

    check_policy_name("mixed_bfloat16")  # 'mixed_bfloat16'
    COMPUTE_DTYPES["mixed_bfloat16"]  # 'bfloat16'
    PROMOTIONS["mixed_float16"]  # 'mixed_bfloat16'
    check_policy_name("float8", "rules[0].policy", RULE_POLICIES)  # 'float8'
"""

from __future__ import annotations

from mpt_keras.errors import UserInputError

POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16")
# What `--precision` and a config's "precision" take: a policy, or `auto`.
PRECISIONS = (*POLICY_NAMES, "auto")
# The policies a calibration measures each layer in.
LOW_PRECISION_POLICIES = ("mixed_float16", "mixed_bfloat16")
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
# One step up the ladder: float16 -> bfloat16 (float32's exponent range) -> float32.
PROMOTIONS = {"mixed_float16": "mixed_bfloat16", "mixed_bfloat16": "float32"}
# A manifest rule's policy may also be float8: the matching Dense and
# EinsumDense layers train their matmuls in float8 (`float8`), computing the
# rest in the manifest's default policy. Not a default nor a `--precision`:
# most layers cannot.
FLOAT8 = "float8"
RULE_POLICIES = (*POLICY_NAMES, FLOAT8)
# Keras names a float8 layer's policy after the one it computes in otherwise.
FLOAT8_POLICY_PREFIX = "float8_from_"


def promoted_policy(name: str) -> str | None:
    """The policy one step up the ladder from `name`, or None at its top.

    A float8 layer (`float8_from_<policy>`) goes to the policy it computes in
    otherwise, its matmuls out of float8; then up `PROMOTIONS`.

    Args:
        name: A layer's effective policy name.
    """
    if name.startswith(FLOAT8_POLICY_PREFIX):
        return name.removeprefix(FLOAT8_POLICY_PREFIX)
    return PROMOTIONS.get(name)


def check_policy_name(
    name: str, source: str = "precision", allowed: tuple[str, ...] = POLICY_NAMES
) -> str:
    """Returns `name` if it is one of `allowed`.

    Args:
        name: The policy name received.
        source: What it came from (a key, a flag), for the message.
        allowed: The names allowed there: `POLICY_NAMES`, or `RULE_POLICIES`
            for a manifest rule.

    Raises:
        UserInputError: Naming `source` and the allowed names otherwise.
    """
    if name not in allowed:
        raise UserInputError(f"{source}: unknown policy '{name}'. Allowed: {', '.join(allowed)}")
    return name

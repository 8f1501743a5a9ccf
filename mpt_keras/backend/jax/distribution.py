"""A JAX run's strategy by name (`backend.names.STRATEGIES_ON["jax"]`): a Keras distribution.

auto           data_parallel over the local devices when there are several, else one_device
one_device     the first device (Keras' default placement)
data_parallel  `keras.distribution.DataParallel` over the local devices, or `virtual_cpus` CPUs
"""

from __future__ import annotations

import os

import jax
import keras

from mpt_keras.backend.names import check_strategy
from mpt_keras.checks import check_number
from mpt_keras.errors import UserInputError


def make_distribution(
    name: str, virtual_cpus: int = 0, tpu: str | None = None
) -> keras.distribution.Distribution | None:
    """The distribution for strategy `name` (None: one device); run under its `scope()`.

    `virtual_cpus` (`data_parallel` only; 0: off) splits the CPU into that many devices, which
    JAX allows only before its first operation. `UserInputError`: a strategy or argument JAX
    does not serve here, or virtual CPUs too late.
    """
    check_strategy(name, "jax")
    check_number("virtual_cpus", virtual_cpus, minimum=0, integer=True)
    if tpu is not None:
        raise UserInputError(
            f"tpu='{tpu}' is TensorFlow's TPUStrategy address, not served on Keras backend jax. "
            "Allowed on jax: no tpu (JAX finds a local TPU itself)"
        )
    if virtual_cpus and name != "data_parallel":
        raise UserInputError(
            f"virtual_cpus={virtual_cpus} needs strategy 'data_parallel' on Keras backend jax; "
            f"received strategy '{name}'. Allowed: virtual_cpus=0, or strategy 'data_parallel'"
        )
    if virtual_cpus:
        _split_cpu(virtual_cpus)
    if name == "one_device" or (name == "auto" and len(jax.local_devices()) == 1):
        return None
    return keras.distribution.DataParallel()


def deterministic_gpu_ops() -> None:
    """Asks XLA for deterministic GPU kernels (scatter, reductions), as `--deterministic` asks
    TensorFlow; XLA reads it when JAX starts its backends, so a late call changes nothing (on
    CPUs XLA's programs are deterministic anyway)."""
    flag = "--xla_gpu_deterministic_ops=true"
    existing = os.environ.get("XLA_FLAGS", "")
    if flag not in existing.split():
        os.environ["XLA_FLAGS"] = f"{existing} {flag}".strip()


def _split_cpu(virtual_cpus: int) -> None:
    try:
        jax.config.update("jax_num_cpu_devices", virtual_cpus)
    except RuntimeError:
        existing = len(jax.devices("cpu"))
        if existing != virtual_cpus:
            raise UserInputError(
                f"virtual_cpus={virtual_cpus}: JAX is already initialized with {existing} CPU "
                "device(s), so the CPU can no longer be split; choose the strategy before any "
                f"other JAX operation. Allowed now: virtual_cpus={existing}"
            ) from None

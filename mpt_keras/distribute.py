"""tf.distribute strategies by name.

    auto         what the machine has; on one device, TensorFlow's default
                 strategy (no distribution machinery in the input pipeline)
    one_device   OneDeviceStrategy on the first GPU, else the CPU

`mirrored`, `multi_worker` and `tpu` are valid names in a config, but this
version does not run them yet: `make_strategy` says so in one line.
"""

from __future__ import annotations

import tensorflow as tf

from mpt_keras.errors import UserInputError

SUPPORTED_STRATEGIES = ("auto", "one_device")


def make_strategy(name: str, virtual_cpus: int = 0) -> tf.distribute.Strategy:
    """Creates the strategy `name`.

    Args:
        name: A strategy name, see the module docstring.
        virtual_cpus: Logical CPU devices to split the CPU into (for `mirrored`).

    Raises:
        UserInputError: For a strategy this version does not run.
    """
    if name not in SUPPORTED_STRATEGIES:
        raise UserInputError(
            f"strategy '{name}' is not supported yet. Allowed: {', '.join(SUPPORTED_STRATEGIES)}"
        )
    if virtual_cpus:
        raise UserInputError(
            f"virtual_cpus={virtual_cpus} needs strategy 'mirrored', which is not supported "
            "yet. Allowed: 0"
        )
    if name == "auto":
        return tf.distribute.get_strategy()
    gpus = tf.config.list_logical_devices("GPU")
    return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")

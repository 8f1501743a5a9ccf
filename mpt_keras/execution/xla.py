"""XLA for the train step: the whole step on one device, each replica's pass under a strategy.

XLA cannot compile a mirrored strategy's all-reduce and merged-context update (Keras turns
XLA off there); on one device the whole step (outside, the unfused update cost 5-9%).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.backend.tensorflow import train_function
from mpt_keras.backend.tensorflow.compiled import xla_function
from mpt_keras.backend.tensorflow.distribute import on_one_device
from mpt_keras.backend.tensorflow.distributed_fit import support_distributed_fit
from mpt_keras.checks import refusal
from mpt_keras.errors import UserInputError
from mpt_keras.execution.replica_step import make_forward_backward, make_step

# What compile_model sets on a model, removed (with `support_distributed_fit`'s) on re-compile.
_INSTALLED_ATTRIBUTES = ("train_step", "test_step")


def compile_model(
    model: keras.Model,
    *,
    optimizer: keras.optimizers.Optimizer,
    loss: Any,
    metrics: Sequence[Any] | None = None,
    jit_compile: bool,
    **compile_kwargs: Any,
) -> None:
    """Compiles `model`, with XLA if `jit_compile`: whole step on one device, else per replica.

    Call under the strategy's scope. The train step becomes `replica_step`'s (`evaluate`
    and `predict` stay without XLA) until a plain `model.compile`; it is no part of the
    model's config, so a loaded model trains without XLA until this is called again.
    `jit_compile`: a bool (`jit_rule.resolve_jit_compile` resolves `auto`); a non-bool, or
    True with `run_eagerly=True`, raises `UserInputError`.
    """
    if not isinstance(jit_compile, bool):
        raise refusal("jit_compile", repr(jit_compile), "True or False")
    if jit_compile and compile_kwargs.get("run_eagerly"):
        raise UserInputError(
            "jit_compile=True cannot run eagerly. Received: run_eagerly=True; "
            "allowed with XLA: run_eagerly=False"
        )
    model.compile(
        optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False, **compile_kwargs
    )
    # Instance attributes, so they never reach the model's config.
    for name in _INSTALLED_ATTRIBUTES:
        vars(model).pop(name, None)
    compat.restore_maybe_symbolic_build(model)
    model.train_step = _replica_train_step(model, jit_compile)
    train_function.install(model)
    support_distributed_fit(model)


def _replica_train_step(model: keras.Model, jit_compile: bool) -> Callable[[Any], dict[str, Any]]:
    """Keras' TensorFlow train step, in XLA if asked: whole on one replica, else split."""
    # A plain `model.compile` makes a new compile config: Keras' own step from then on.
    compiled_with = compat.compile_config(model)

    def train_step(data: Any) -> dict[str, Any]:
        if compat.compile_config(model) is not compiled_with:
            return type(model).train_step(model, data)
        whole_step_in_xla = jit_compile and on_one_device()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # New functions per trace: a cached one keeps the loss and optimizer first traced.
        forward_backward = make_forward_backward(model)
        if jit_compile and not whole_step_in_xla:
            forward_backward = xla_function(forward_backward)
        step = make_step(model, forward_backward)
        if whole_step_in_xla:
            step = xla_function(step)
        return step(x, y, sample_weight)

    return train_step

"""Loss scaling that is never silently missing: `model.compile` gives float16 layers ours.

Keras wraps the optimizer in a loss-scale optimizer only when the model's own
dtype policy is `mixed_float16`, and then in its stock
`keras.optimizers.LossScaleOptimizer`. A model whose layers a
`PrecisionManifest` put in `mixed_float16` keeps its own float32 policy, so
`model.compile(optimizer="adam")` trained those layers without any loss scale
and said nothing: their small gradients underflowed to zero.

`install` hooks Keras' `Trainer.compile`, which every `keras.Model` runs, once
however often it is called (`import mpt_keras` calls it, and so does importing
`mpt_keras.precision.manifest`). When the model computes in float16 (its own policy, or
any layer at any depth, in nested models and inside layers too), the hook
picks the optimizer Keras compiles it with, by what was passed:

    a plain optimizer or name    mpt_keras.LossScaleOptimizer around it, with
                                 the settings of Keras' own wrap (info log)
    mpt_keras.LossScaleOptimizer as passed
    another LossScaleOptimizer   as passed, and a warning that ours adds bounds
                                 and one verdict for all replicas
    auto_scale_loss=False        as passed (the user's opt-out), and a warning

A model loaded from a `.keras` file saved with the stock
`keras.optimizers.LossScaleOptimizer` compiles with ours instead, its saved
state loaded into ours (`LossScaleOptimizer.load_own_variables`).

So every path to training float16 layers (a manifest, a global policy,
`mpt_keras.execution.xla.compile_model`, a `.keras` file compiled on load) is loss
scaled by ours, since Keras does not wrap a loss-scale optimizer again. A model
with no float16 layer compiles exactly as in Keras.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)
# Set on our compile function, so that installing again finds it in place.
_HOOK_MARK = "_mpt_keras_loss_scaling"
# The name Keras gives the loss-scale optimizer it wraps around a plain one.
_KERAS_WRAPPER_NAME = "loss_scale_optimizer"
# Set while Keras compiles a model it loads from a file (this thread only).
_LOADING = threading.local()


def install() -> None:
    """Makes `model.compile` loss-scale float16 models with `mpt_keras.LossScaleOptimizer`.

    Idempotent: the hook is installed once, whatever the number of calls.
    See the module docstring for what the hook decides.
    """
    trainer = compat.keras_trainer_class()
    if getattr(trainer.compile, _HOOK_MARK, False):
        return
    hooked = _compile_with_loss_scaling(trainer.compile)
    setattr(hooked, _HOOK_MARK, True)
    trainer.compile = hooked
    trainer.compile_from_config = _loading(trainer.compile_from_config)


def _loading(compile_from_config: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' `compile_from_config`, during which a stock loss-scale optimizer becomes ours."""

    @functools.wraps(compile_from_config)
    def hooked_compile_from_config(model: keras.Model, config: Any) -> Any:
        _LOADING.active = True
        try:
            return compile_from_config(model, config)
        finally:
            _LOADING.active = False

    return hooked_compile_from_config


def _ours_for_stock(optimizer: Any) -> Any:
    """A stock `keras.optimizers.LossScaleOptimizer` loaded from a file, as ours.

    Same inner optimizer, scale and growth steps; the saved state loads into
    ours too (`LossScaleOptimizer.load_own_variables`).
    """
    stock = keras.optimizers.LossScaleOptimizer
    if not isinstance(optimizer, stock) or isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    _LOGGER.info(
        "a model saved with keras.optimizers.LossScaleOptimizer loads with "
        "mpt_keras.LossScaleOptimizer, its state included"
    )
    return LossScaleOptimizer(
        optimizer.inner_optimizer,
        initial_scale=optimizer.initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        name=optimizer.name,
    )


def _compile_with_loss_scaling(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' `compile_`, given `_loss_scaled`'s optimizer when the model computes in float16."""
    signature = inspect.signature(compile_)

    @functools.wraps(compile_)
    def hooked_compile(model: keras.Model, *args: Any, **kwargs: Any) -> Any:
        if getattr(_LOADING, "active", False):
            arguments = signature.bind(model, *args, **kwargs)
            arguments.arguments["optimizer"] = _ours_for_stock(arguments.arguments.get("optimizer"))
            args, kwargs = arguments.args[1:], arguments.kwargs
        float16_layers = _float16_layers(model)
        if not (float16_layers or _computes_in_float16(model)):
            result = compile_(model, *args, **kwargs)
        else:
            arguments = signature.bind(model, *args, **kwargs)
            arguments.apply_defaults()
            values = arguments.arguments
            values["optimizer"] = _loss_scaled(
                values["optimizer"],
                values["auto_scale_loss"],
                f"model '{model.name}' computes in float16 ({len(float16_layers)} of its layers)",
            )
            result = compile_(*arguments.args, **arguments.kwargs)
        _hand_batches_over(model)
        return result

    return hooked_compile


def _hand_batches_over(model: keras.Model) -> None:
    """With our optimizer, Keras' train step hands it each batch to judge, and logs its state.

    So a batch holding a NaN or Inf counts as bad data, not an overflow, under
    a plain `model.compile` too, and the step's logs (those every callback gets)
    hold `LossScaleOptimizer.step_logs()`. The class's own `train_step` is wrapped, so
    compiling again does not stack wrappers, and a compile with another
    optimizer removes it.
    """
    if _is_hand_over(vars(model).get("train_step")):
        del vars(model)["train_step"]
    optimizer = model.optimizer
    if not isinstance(optimizer, LossScaleOptimizer):
        return
    class_step = type(model).train_step

    def train_step(data: Any) -> Any:
        optimizer.hand_over_batch(data, state=model.non_trainable_variables)
        logs = class_step(model, data)
        if not isinstance(logs, dict):
            return logs
        return {**logs, **optimizer.step_logs()}

    setattr(train_step, _HOOK_MARK, True)
    model.train_step = train_step


def _is_hand_over(step: Any) -> bool:
    return getattr(step, _HOOK_MARK, False)


def _loss_scaled(optimizer: Any, auto_scale_loss: bool, why: str) -> Any:
    """The optimizer a float16 model compiles with: ours, unless the user chose otherwise.

    Args:
        optimizer: What was passed to `model.compile`: an optimizer, its name
            or its config (resolved here as Keras would, by `keras.optimizers.get`).
        auto_scale_loss: `model.compile`'s argument; False is the user's opt-out.
        why: Which model computes in float16, to start the log lines.

    Returns:
        The resolved optimizer, wrapped in `mpt_keras.LossScaleOptimizer` if it
        is a plain optimizer and `auto_scale_loss` is True.
    """
    optimizer = keras.optimizers.get(optimizer)
    if optimizer is None or isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _LOGGER.warning(
            "%s: kept the %s passed to compile; mpt_keras.LossScaleOptimizer adds scale "
            "bounds, one finiteness verdict for all replicas, bad-batch skipping and telemetry",
            why,
            type(optimizer).__name__,
        )
        return optimizer
    if not auto_scale_loss:
        _LOGGER.warning(
            "%s and was compiled with auto_scale_loss=False: its gradients are not loss "
            "scaled, so small ones underflow to zero. To scale them, compile with "
            "optimizer=mpt_keras.LossScaleOptimizer(...) or without auto_scale_loss=False",
            why,
        )
        return optimizer
    _LOGGER.info(
        "%s: compiling its %s wrapped in mpt_keras.LossScaleOptimizer",
        why,
        type(optimizer).__name__,
    )
    # As Keras' own wrap: its defaults (scale 2**15, growth every 2000 steps) are ours.
    return LossScaleOptimizer(optimizer, name=_KERAS_WRAPPER_NAME)


def _float16_layers(model: keras.Model) -> list[str]:
    """The paths of the layers of `model`, at any depth, that compute in float16."""
    return [path for path, layer in iter_layers(model) if _computes_in_float16(layer)]


def _computes_in_float16(layer: keras.layers.Layer) -> bool:
    return layer.dtype_policy.compute_dtype == "float16"


install()

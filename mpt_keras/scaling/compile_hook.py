"""`model.compile` gives a model with float16 layers our loss scaling, never none.

Keras wraps the optimizer only when the model's own policy is `mixed_float16`, so a model
whose layers a `PrecisionManifest` made float16 trained unscaled, silently. `install` hooks
`Trainer.compile`; when any layer computes in float16, the optimizer passed becomes:

    a plain optimizer or name    mpt_keras.LossScaleOptimizer around it (info log)
    mpt_keras.LossScaleOptimizer as passed
    another LossScaleOptimizer   as passed, and a warning
    auto_scale_loss=False        as passed (the user's opt-out), and a warning

A `.keras` file saved with the stock class loads with ours, its state included.
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
from mpt_keras.backend import current
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.scaling.bad_batch_metrics import MetricsBefore
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)
# Marks our compile and train step functions.
_HOOK_MARK = "_mpt_keras_loss_scaling"
# The name Keras gives the loss-scale optimizer it wraps around a plain one.
_KERAS_WRAPPER_NAME = "loss_scale_optimizer"
# Set while Keras compiles a model it loads from a file (this thread only).
_LOADING = threading.local()


def install() -> None:
    """Hooks `model.compile` (see the module docstring); idempotent."""
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
    """A stock `keras.optimizers.LossScaleOptimizer` loaded from a file, as ours (same settings)."""
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
    """With our optimizer, the train step hands it each batch to judge and logs its state.

    Wraps the class's `train_step`, so compiling again does not stack wrappers and compiling
    with another optimizer removes it. A model's own `train_step` that never scales its loss
    (Keras' guides write it so) gets its gradients applied undivided, with a warning.
    """
    if _is_hand_over(vars(model).get("train_step")):
        del vars(model)["train_step"]
    optimizer = model.optimizer
    if not isinstance(optimizer, LossScaleOptimizer):
        return
    class_step = type(model).train_step
    if current.is_jax():
        train_step = _jax_train_step(model, optimizer, class_step)
        setattr(train_step, _HOOK_MARK, True)
        model.train_step = train_step
        return

    def train_step(data: Any) -> Any:
        optimizer.hand_over_batch(data, state=model.non_trainable_variables)
        before = MetricsBefore(model)
        with optimizer.model_train_step(model.name) as verdict:
            logs = class_step(model, data)
        if verdict.bad is not None:  # A skipped bad batch counts in no metric.
            logs = before.put_back_in_logs(verdict.bad, logs)
        if not isinstance(logs, dict):
            return logs
        return {**logs, **optimizer.step_logs()}

    setattr(train_step, _HOOK_MARK, True)
    model.train_step = train_step


def _jax_train_step(
    model: keras.Model, optimizer: LossScaleOptimizer, class_step: Callable[..., Any]
) -> Callable[[Any, Any], Any]:
    """JAX: Keras' step handing over batch and loss (`jax_train_step`); a model's own
    `train_step` is kept, its logs given the loss-scaling state (its gradients are not divided
    by the scale if it never scales its loss: `LossScaleOptimizer.model_train_step`)."""
    if class_step is keras.Model.train_step:  # Keras' own JAX step.
        from mpt_keras.scaling import jax_train_step

        return functools.partial(jax_train_step.train_step, model, optimizer)

    def train_step(state: Any, data: Any) -> Any:
        with optimizer.model_train_step(model.name):
            logs, state = class_step(model, state, data)
        if not isinstance(logs, dict):
            return logs, state
        trainable, _, optimizer_values, _ = state  # Keras' JAX train state.
        return {**logs, **optimizer.step_logs(optimizer_values, trainable)}, state

    return train_step


def _is_hand_over(step: Any) -> bool:
    return getattr(step, _HOOK_MARK, False)


def _loss_scaled(optimizer: Any, auto_scale_loss: bool, why: str) -> Any:
    """The optimizer a float16 model compiles with: ours, unless the user chose otherwise."""
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
    # Keras' own wrap's settings are our defaults.
    return LossScaleOptimizer(optimizer, name=_KERAS_WRAPPER_NAME)


def _float16_layers(model: keras.Model) -> list[str]:
    return [path for path, layer in iter_layers(model) if _computes_in_float16(layer)]


def _computes_in_float16(layer: keras.layers.Layer) -> bool:
    # Not `dtype_policy.compute_dtype`: a loaded layer holds its block's DTypePolicyMap, whose
    # own compute dtype is the map's default; Keras computes with the layer's entry.
    return layer.compute_dtype == "float16"


install()

"""XLA for the train step: the whole step on one device, each replica's pass under a strategy.

Keras XLA-compiles its whole train function, `strategy.run` included, so under
`MirroredStrategy` or `MultiWorkerMirroredStrategy` XLA would have to compile
the cross-replica all-reduce and the optimizer's merged-context update, which
it cannot (Keras therefore turns `jit_compile="auto"` off under any strategy).
`compile_model` splits the step there instead:

    XLA, per replica    forward pass, loss, gradients of the scaled loss
    outside XLA         loss tracker, optimizer.apply (all-reduce, unscale,
                        finiteness verdict, clip, update) and metrics

so `model.fit` runs XLA under every strategy. On one device (no strategy, or
`OneDeviceStrategy`) there is nothing to all-reduce, and XLA compiles the
whole step, optimizer update included, as Keras does: left outside XLA, the
unfused update of every variable cost the float32 Transformer of `mpt-bench`
5-9% of its step. Without XLA the step is the same, run as TensorFlow ops.
With a `mpt_keras.LossScaleOptimizer`, the step hands it the loss and the
batch (`apply(..., loss=, batch=)`), so a batch holding a NaN or Inf is skipped
as bad data; such a batch adds nothing to the reported loss and metrics.

`resolve_jit_compile` turns the `--jit_compile` setting (`auto`, `true`,
`false`) into that choice. Under `--deterministic` (TensorFlow's op
determinism) XLA has no MaxPool gradient: `auto` keeps XLA off for a model
with max pooling, and `true` is refused with one line. `auto` decides by the
replicas' device type and, on CPUs, by what the model computes, as measured
by `mpt-bench` (which reports the ratios and the `auto` choice side by side;
no GPU or TPU was at hand):

    TPU replicas   XLA on   TPUStrategy compiles everything with XLA anyway
    GPU replicas   XLA on   XLA fuses the elementwise work between kernels
    CPU replicas   XLA on   for models with attention layers in float32 and
                            mixed_float16, and in mixed_bfloat16 up to
                            `XLA_BFLOAT16_MAX_PARAMETERS` (1M) parameters: XLA
                            fuses the softmax, masking and reshapes around the
                            attention matmuls
                   XLA off  for larger attention models in mixed_bfloat16:
                            oneDNN's bfloat16 matmuls (AVX512_BF16) beat XLA's
                            once the matmuls dominate
                   XLA on   for convolutional models in mixed_float16: oneDNN
                            has no float16 here, and XLA's fused float16
                            convolutions beat TensorFlow's Eigen fallback
                   XLA on   for convolutional models in mixed_bfloat16, and
                            attention models of any size, where the CPU has
                            no bfloat16 instructions (`avx512_bf16`,
                            `amx_bf16`): TensorFlow emulates bfloat16 there
                   XLA off  for other models (dense, convolutional), in every
                            precision: TensorFlow's CPU kernels (oneDNN's or
                            Eigen's) are as fast or faster, and an XLA call
                            costs ~5 ms a step
                            here, which small steps cannot repay

Examples per second with XLA over without (ratio of the medians of
interleaved rounds in one `mpt-bench` run on a quiet machine; 2 cores of an
AMD EPYC with AVX512_BF16 and no AVX512_FP16; the reference models: the
Transformer LM with 2 blocks of width 64 on 32x64 tokens, the 8x8 CNN and MLP
on batches of 64; above 1: XLA faster):

                      float32   mixed_bfloat16   mixed_float16
    transformer_lm    1.43      1.25             1.96
    cnn               0.68      0.51             1.01
    mlp               0.20      0.30             0.27

A second run of the Transformer alone (20 rounds) gave 1.46, 1.19 and 1.88.
Wider Transformers (2 blocks, 6 rounds each):

    width (parameters)   float32   mixed_bfloat16   mixed_float16
    64 (0.14M)           1.34      1.18             2.08
    128 (0.47M)          -         1.04             1.80
    256 (1.73M)          -         0.73             1.66
    512 (6.60M)          1.11      0.60             -

so in bfloat16 the crossover lies between 0.47M and 1.73M parameters.
float16, which oneDNN lacks here (TensorFlow falls back to Eigen), is slow
with or without XLA for the CNN, and XLA's per-call cost still dominates the
MLP. The float16 CNN's ratio varied between runs: 1.01 above, then 1.20 (and
1.14 for stock Keras) in a later 15-round `mpt-bench` run, after 1.13 for
stock Keras in an earlier one: XLA on for float16 convolutions.

On 2 cores of an AMD EPYC with AVX2 only (no AVX512, no bfloat16
instructions, oneDNN off by default), one 10-round `mpt-bench` run measured:

                      float32   mixed_bfloat16   mixed_float16
    transformer_lm    1.91      3.46             1.83
    cnn               0.66      2.04             0.95
    mlp               0.25      0.33             0.29

and a second one, with the rule above: 1.72, 3.63, 1.85 / 0.71, 2.10, 0.97 /
0.26, 0.31, 0.32; a third, with the whole step in XLA on one device: 2.29,
3.33, 1.86 / 0.73, 2.28, 1.00 / 0.26, 0.31, 0.33. bfloat16 matmuls ran at
0.86-0.96x float32's peak there, and the bfloat16 CNN without XLA trained at
0.27-0.32x float32's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.backend.tensorflow import distribute, train_function
from mpt_keras.config import JIT_COMPILE
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.hardware import cpu_bfloat16_flags, probe_hardware
from mpt_keras.precision.names import check_policy_name
from mpt_keras.scaling.optimizer import LossScaleOptimizer, state_before

# Above this many parameters, a bfloat16 attention model trains faster without
# XLA on CPUs (measured crossover: between 0.47M and 1.73M; module docstring).
XLA_BFLOAT16_MAX_PARAMETERS = 1_000_000
_CONVOLUTIONS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
# Layers whose gradient XLA cannot compute under TensorFlow's op determinism
# ("GPU MaxPool gradient ops do not yet have a deterministic XLA
# implementation", on every device type).
_NO_DETERMINISTIC_XLA_GRADIENT = {
    keras.layers.MaxPooling1D: "MaxPool",
    keras.layers.MaxPooling2D: "MaxPool",
    keras.layers.MaxPooling3D: "MaxPool",
}
# What compile_model sets on a model; removed again when it re-compiles (with
# the build that `distribute.support_multi_worker_fit` sets).
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

    The model is compiled with `model.compile(..., jit_compile=False)` and its
    train step (for `fit` and `train_on_batch`) is replaced by one that
    computes each replica's forward pass, loss and gradients of
    `optimizer.scale_loss(loss)`, then applies them with `optimizer.apply` in
    the replica context, where a strategy all-reduces them. With
    `jit_compile`, XLA compiles the whole step on one device (no strategy, or
    `OneDeviceStrategy`), and under other strategies each replica's forward
    and backward pass only, the all-reduce and the update staying outside
    XLA (see the module docstring). With a
    `mpt_keras.LossScaleOptimizer` a batch with a NaN or Inf is skipped and
    counted (`optimizer.bad_batches`) and left out of the loss and every metric.
    `evaluate` and `predict` run without XLA.

    Under a multi-worker MultiWorkerMirroredStrategy it also makes Keras'
    `fit` and `evaluate` work there (`distribute.support_multi_worker_fit`).

    Call it under the strategy's scope, like `model.compile`. Calling it again
    re-compiles (with or without XLA); a later plain `model.compile` restores
    Keras' own train step. The replaced step is not part of the model's
    config: `model.save` records `jit_compile=False`, and a loaded model trains
    without XLA until `compile_model` is called on it.

    Args:
        model: The model to compile.
        optimizer: Its optimizer, e.g. a `mpt_keras.LossScaleOptimizer`.
        loss: As for `model.compile`.
        metrics: As for `model.compile`.
        jit_compile: Whether to XLA-compile each replica's forward and backward
            pass (a bool: resolve `"auto"` with `resolve_jit_compile` first).
        **compile_kwargs: More `model.compile` arguments (`steps_per_execution`,
            `weighted_metrics`, ...), except `run_eagerly=True` with XLA.

    Raises:
        UserInputError: If `jit_compile` is not a bool, or is True together with
            `run_eagerly=True`.

    Example:

        with strategy.scope():
            model = build_model()
            compile_model(
                model,
                optimizer=LossScaleOptimizer(keras.optimizers.AdamW(1e-3)),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                jit_compile=True,
            )
        model.fit(dataset, epochs=2)
    """
    if not isinstance(jit_compile, bool):
        raise UserInputError(f"jit_compile must be True or False. Received: {jit_compile!r}")
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
    distribute.support_multi_worker_fit(model)


def resolve_jit_compile(
    setting: str,
    strategy: tf.distribute.Strategy,
    precision: str,
    model: keras.Model | None = None,
    *,
    deterministic: bool = False,
) -> tuple[bool, str]:
    """Chooses whether to XLA-compile the replicas' train step.

    Args:
        setting: `"true"`, `"false"` or `"auto"` (the rule in the module
            docstring: by the device type of the strategy's replicas and, on
            CPUs, whether `model` has attention layers or convolutions, and
            whether the CPU has bfloat16 instructions).
        strategy: The strategy the model trains under.
        precision: The run's dtype policy name (`float32`, `mixed_float16`,
            `mixed_bfloat16`).
        model: The model to train; `None` counts as a model without attention.
        deterministic: Whether the run enables TensorFlow's op determinism.
            XLA has no deterministic gradient for some layers (max pooling):
            with such a layer, `auto` keeps XLA off and `true` is refused.

    Returns:
        `(jit_compile, reason)`, the reason a one-line explanation for logs.

    Raises:
        UserInputError: For a setting or precision outside the allowed names,
            or `true` with `deterministic` on a model XLA cannot step
            deterministically.

    Example:

        jit_compile, reason = resolve_jit_compile("auto", strategy, "mixed_bfloat16", model)
        jit_compile  # on a CPU-only machine: True for a Transformer, False for a CNN
        reason  # 'jit_compile=auto: CPU replicas, mixed_bfloat16: XLA on, ...'
    """
    if setting not in JIT_COMPILE:
        raise UserInputError(
            f"jit_compile: unknown setting '{setting}'. Allowed: {', '.join(JIT_COMPILE)}"
        )
    check_policy_name(precision)
    blocker = _no_deterministic_xla_gradient(model) if deterministic else None
    if setting == "true" and blocker:
        raise UserInputError(
            f"jit_compile=true with deterministic: XLA has no deterministic {blocker}. Use "
            "jit_compile=false or auto (XLA off for this model), or train without deterministic"
        )
    if setting != "auto":
        return setting == "true", f"jit_compile={setting}: as set"
    if blocker:
        return False, f"jit_compile=auto, deterministic: XLA off, it has no deterministic {blocker}"
    device_type = _replica_device_type(strategy)
    prefix = f"jit_compile=auto: {device_type} replicas, {precision}: XLA"
    if device_type != "CPU":
        return True, f"{prefix} on, the fast path on accelerators"
    # Where the CPU has no bfloat16 arithmetic, TensorFlow's bfloat16 kernels
    # emulate it (and oneDNN is off by default on such CPUs).
    emulated_bfloat16 = precision == "mixed_bfloat16" and not cpu_bfloat16_flags(probe_hardware())
    if model is not None and _has_attention(model):
        parameters = model.count_params()
        if (
            precision == "mixed_bfloat16"
            and not emulated_bfloat16
            and parameters > XLA_BFLOAT16_MAX_PARAMETERS
        ):
            return False, (
                f"{prefix} off, an attention model of {parameters:,} parameters (over "
                f"{XLA_BFLOAT16_MAX_PARAMETERS:,}): oneDNN's bfloat16 matmuls are faster"
            )
        return True, f"{prefix} on, the model has attention layers (XLA fuses around them)"
    if model is not None and _has_convolution(model):
        if precision == "mixed_float16":
            return True, (
                f"{prefix} on, float16 convolutions: XLA's beat TensorFlow's Eigen fallback "
                "(no oneDNN float16 here)"
            )
        if emulated_bfloat16:
            return True, (
                f"{prefix} on, bfloat16 convolutions on a CPU without bfloat16 instructions: "
                "XLA's beat TensorFlow's emulated ones"
            )
    return False, (
        f"{prefix} off, no attention layers: TensorFlow's CPU kernels are as fast or faster"
    )


def _no_deterministic_xla_gradient(model: keras.Model | None) -> str | None:
    """What in `model` XLA cannot differentiate deterministically, e.g. "MaxPool gradient
    (layer 'pool_1')"; None if nothing."""
    for path, layer in iter_layers(model) if model is not None else ():
        for layer_type, op in _NO_DETERMINISTIC_XLA_GRADIENT.items():
            if isinstance(layer, layer_type):
                return f"{op} gradient (layer '{path}', {type(layer).__name__})"
    return None


def _has_attention(model: keras.Model) -> bool:
    return any(
        isinstance(layer, keras.layers.MultiHeadAttention) or "Attention" in type(layer).__name__
        for _, layer in iter_layers(model)
    )


def _has_convolution(model: keras.Model) -> bool:
    return any(isinstance(layer, _CONVOLUTIONS) for _, layer in iter_layers(model))


def _replica_device_type(strategy: tf.distribute.Strategy) -> str:
    """`TPU`, `GPU` or `CPU`: where the strategy's replicas compute."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:
        # TensorFlow's default strategy names no devices: it runs where ops
        # are placed by default, on the first GPU if there is one.
        return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    types = {tf.DeviceSpec.from_string(device).device_type for device in devices}
    return next((kind for kind in ("TPU", "GPU") if kind in types), "CPU")


def _replica_train_step(model: keras.Model, jit_compile: bool) -> Callable[[Any], dict[str, Any]]:
    """Keras' TensorFlow train step, in XLA if asked: whole on one replica, else split."""
    # A plain `model.compile` makes a new compile config: from then on the
    # model trains with Keras' own step, as that compile asked.
    compiled_with = compat.compile_config(model)

    def train_step(data: Any) -> dict[str, Any]:
        if compat.compile_config(model) is not compiled_with:
            return type(model).train_step(model, data)
        whole_step_in_xla = jit_compile and _on_one_device()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # New functions for each trace of the train function: a cached one
        # would keep the loss and optimizer it was first traced with.
        forward_backward = _forward_backward(model)
        if jit_compile and not whole_step_in_xla:
            forward_backward = _xla_function(forward_backward)
        step = _step(model, forward_backward)
        if whole_step_in_xla:
            step = _xla_function(step)
        return step(x, y, sample_weight)

    return train_step


def _on_one_device() -> bool:
    """Whether the step being traced runs on one device, with no strategy to sync replicas.

    Then XLA can compile the whole step. Any other strategy, even with one
    replica, merges the update into its cross-replica context (`merge_call`),
    which cannot happen inside a nested function such as an XLA one.
    """
    return not tf.distribute.has_strategy() or isinstance(
        tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy
    )


def _step(
    model: keras.Model, forward_backward: Callable[[Any, Any, Any], tuple[Any, Any, Any]]
) -> Callable[[Any, Any, Any], dict[str, Any]]:
    def replica_train_step(x: Any, y: Any, sample_weight: Any) -> dict[str, Any]:
        optimizer = model.optimizer
        checked = isinstance(optimizer, LossScaleOptimizer)
        # Batch-norm statistics as before the step: a skipped step puts them back.
        state = state_before(model.non_trainable_variables) if checked else []
        loss, y_pred, gradients = forward_backward(x, y, sample_weight)
        batch_size = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
        if checked:
            # The loss and the batch, handed over explicitly: the loss given to
            # `scale_loss` may live in a nested XLA function's graph.
            bad = optimizer.apply(
                gradients,
                model.trainable_weights,
                loss=loss,
                batch=(x, y, sample_weight),
                state=state,
            )
        else:
            optimizer.apply(gradients, model.trainable_weights)
        # A skipped bad batch counts in no metric: it would make the epoch's
        # mean loss NaN, and what it predicted is undefined (XLA's and
        # TensorFlow's argmax of a NaN row differ). So the metrics take it,
        # then get their values from before it back. (`fit` has built them
        # before this traces.)
        variables = [v for metric in model.metrics for v in metric.variables] if checked else []
        before = [tf.convert_to_tensor(variable) for variable in variables]
        compat.loss_tracker(model).update_state(
            compat.unscale_loss_for_distribution(loss), sample_weight=batch_size
        )
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if not checked:
            return logs

        def restore() -> None:
            for variable, value in zip(variables, before):
                variable.assign(value)

        compat.called_cond(bad, restore, lambda: None)
        return {**model.get_metrics_result(), **optimizer.step_logs()}

    return replica_train_step


def _xla_function(function: Callable[..., Any]) -> Callable[..., Any]:
    return tf.function(function, jit_compile=True)


def _forward_backward(model: keras.Model) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
    def replica_forward_backward(x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        # As Keras' own train step: `training` only for models whose call
        # takes it, and `compute_loss` also for overrides without it.
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if compat.call_has_training_arg(model) else model(x)
            loss = compat.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            scaled_loss = model.optimizer.scale_loss(loss)
        return loss, y_pred, tape.gradient(scaled_loss, model.trainable_weights)

    return replica_forward_backward

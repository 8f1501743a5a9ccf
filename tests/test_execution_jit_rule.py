"""Tests for mpt_keras.execution.jit_rule: the `jit_compile` rule, `auto` by device and model."""

from __future__ import annotations

import types
from typing import Any

import keras
import pytest
import tensorflow as tf

from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.execution import jit_rule
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.names import POLICY_NAMES


def _mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    return models.build_mlp((8,), 4, hidden_units=(32, 16), dropout=0.0)


def _fake_strategy(*devices: str) -> Any:
    """A strategy as resolve_jit_compile sees it: its replicas' devices."""
    return types.SimpleNamespace(extended=types.SimpleNamespace(worker_devices=devices))


class _DefaultStrategyExtended:
    """Like TensorFlow's default strategy, it names no devices."""

    @property
    def worker_devices(self):
        raise RuntimeError("worker_devices() method unsupported by default tf.distribute.Strategy.")


def _default_strategy() -> Any:
    return types.SimpleNamespace(extended=_DefaultStrategyExtended())


@pytest.mark.parametrize("precision", POLICY_NAMES)
@pytest.mark.parametrize(
    ("strategy", "visible_gpus", "device_type"),
    [
        (_fake_strategy("/job:worker/replica:0/task:0/device:TPU:0"), 0, "TPU"),
        (_fake_strategy("/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:1"), 2, "GPU"),
        (_fake_strategy("/job:worker/replica:0/task:1/device:CPU:0"), 0, "CPU"),
        (_fake_strategy("/device:CPU:0", "/device:CPU:1"), 0, "CPU"),
        (_default_strategy(), 1, "GPU"),
        (_default_strategy(), 0, "CPU"),
    ],
    ids=["tpu", "two_gpus", "cpu_worker", "virtual_cpus", "default_on_gpu", "default_on_cpu"],
)
@pytest.mark.parametrize("cpu_flags", [("avx2",), ("avx2", "avx512_bf16")], ids=["avx2", "bf16"])
def test_auto_rule(monkeypatch, strategy, visible_gpus, device_type, precision, cpu_flags):
    gpus = [f"/device:GPU:{i}" for i in range(visible_gpus)]
    monkeypatch.setattr(
        tf.config,
        "list_logical_devices",
        lambda kind=None: gpus if kind == "GPU" else pytest.fail("unexpected device query"),
    )
    _fake_cpu(monkeypatch, cpu_flags)
    # XLA on accelerators; on CPUs for models with attention, and for
    # convolutions in float16, or in bfloat16 on a CPU without bfloat16.
    emulated_bfloat16 = precision == "mixed_bfloat16" and "avx512_bf16" not in cpu_flags
    for model, on_cpu in (
        (_mlp(), False),
        (_transformer(), True),
        (_cnn(), precision == "mixed_float16" or emulated_bfloat16),
        (None, False),
    ):
        expected = device_type != "CPU" or on_cpu
        jit_compile, reason = jit_rule.resolve_jit_compile("auto", strategy, precision, model)
        assert jit_compile is expected
        state = "on" if expected else "off"
        assert reason.startswith(
            f"jit_compile=auto: {device_type} replicas, {precision}: XLA {state}, "
        )


def _fake_cpu(monkeypatch, cpu_flags: tuple[str, ...]) -> None:
    """Makes `resolve_jit_compile` see a CPU with `cpu_flags`."""
    monkeypatch.setattr(jit_rule, "probe_hardware", lambda: HardwareProbe(frozenset(cpu_flags)))


def _cnn() -> keras.Model:
    return models.build_cnn((8, 8, 1), 10)


def _transformer() -> keras.Model:
    return models.build_transformer_lm(256, 16, num_layers=1, d_model=16, num_heads=2)


class _CustomAttention(keras.layers.Layer):
    def call(self, inputs):
        return inputs


@pytest.mark.parametrize("precision", POLICY_NAMES)
def test_auto_on_cpu_replicas(precision):
    strategy = _fake_strategy("/device:CPU:0")  # CPU replicas, on any host
    assert jit_rule.resolve_jit_compile("auto", strategy, precision, _transformer()) == (
        True,
        f"jit_compile=auto: CPU replicas, {precision}: XLA on, the model has attention "
        "layers (XLA fuses around them)",
    )
    assert jit_rule.resolve_jit_compile("auto", strategy, precision, _mlp()) == (
        False,
        f"jit_compile=auto: CPU replicas, {precision}: XLA off, no attention layers: "
        "TensorFlow's CPU kernels are as fast or faster",
    )
    custom = keras.Sequential([keras.Input((4,)), _CustomAttention()])
    assert jit_rule.resolve_jit_compile("auto", strategy, precision, custom)[0] is True
    if precision == "mixed_float16":
        assert jit_rule.resolve_jit_compile("auto", strategy, precision, _cnn()) == (
            True,
            "jit_compile=auto: CPU replicas, mixed_float16: XLA on, float16 convolutions: "
            "XLA's beat TensorFlow's Eigen fallback (no oneDNN float16 here)",
        )


@pytest.mark.parametrize("precision", POLICY_NAMES)
def test_deterministic_keeps_xla_off_where_it_has_no_deterministic_gradient(precision):
    """XLA has no deterministic MaxPool gradient; every other choice stands."""
    strategy = _fake_strategy("/device:CPU:0")  # CPU replicas, on any host
    reason = (
        "jit_compile=auto, deterministic: XLA off, it has no deterministic MaxPool gradient "
        "(layer 'pool_0', MaxPooling2D)"
    )
    resolve = jit_rule.resolve_jit_compile
    assert resolve("auto", strategy, precision, _cnn(), deterministic=True) == (False, reason)
    with pytest.raises(UserInputError) as raised:
        jit_rule.resolve_jit_compile("true", strategy, precision, _cnn(), deterministic=True)
    assert str(raised.value).startswith("jit_compile=true with deterministic: XLA has no")
    assert jit_rule.resolve_jit_compile("true", strategy, precision, _cnn()) == (
        True,
        "jit_compile=true: as set",
    )
    for model in (_transformer(), _mlp()):
        assert jit_rule.resolve_jit_compile(
            "auto", strategy, precision, model, deterministic=True
        ) == jit_rule.resolve_jit_compile("auto", strategy, precision, model)
    nested = keras.Sequential([keras.Input((8, 8, 1)), keras.Sequential([_cnn()])])
    assert resolve("auto", strategy, precision, nested, deterministic=True)[0] is False


@pytest.mark.parametrize(
    ("precision", "expected"),
    [("float32", True), ("mixed_float16", True), ("mixed_bfloat16", False)],
)
def test_auto_keeps_large_bfloat16_attention_models_off_xla_on_cpu(
    monkeypatch, precision, expected
):
    _fake_cpu(monkeypatch, ("avx512_bf16",))
    model = _transformer()
    assert model.count_params() <= jit_rule.XLA_BFLOAT16_MAX_PARAMETERS
    strategy = _fake_strategy("/device:CPU:0")  # CPU replicas, on any host
    assert jit_rule.resolve_jit_compile("auto", strategy, precision, model)[0] is True
    monkeypatch.setattr(jit_rule, "XLA_BFLOAT16_MAX_PARAMETERS", model.count_params() - 1)
    jit_compile, reason = jit_rule.resolve_jit_compile("auto", strategy, precision, model)
    assert jit_compile is expected
    if not expected:
        assert reason == (
            "jit_compile=auto: CPU replicas, mixed_bfloat16: XLA off, an attention model of "
            f"{model.count_params():,} parameters (over {model.count_params() - 1:,}): "
            "oneDNN's bfloat16 matmuls are faster"
        )


def test_auto_keeps_large_attention_models_on_xla_where_bfloat16_is_emulated(monkeypatch):
    _fake_cpu(monkeypatch, ("avx2",))
    model = _transformer()
    monkeypatch.setattr(jit_rule, "XLA_BFLOAT16_MAX_PARAMETERS", model.count_params() - 1)
    strategy = _fake_strategy("/device:CPU:0")  # CPU replicas, on any host
    assert jit_rule.resolve_jit_compile("auto", strategy, "mixed_bfloat16", model)[0] is True
    assert jit_rule.resolve_jit_compile("auto", strategy, "mixed_bfloat16", _cnn()) == (
        True,
        "jit_compile=auto: CPU replicas, mixed_bfloat16: XLA on, bfloat16 convolutions on "
        "a CPU without bfloat16 instructions: XLA's beat TensorFlow's emulated ones",
    )


@pytest.mark.parametrize(("setting", "expected"), [("true", True), ("false", False)])
def test_explicit_settings_are_kept(setting, expected):
    strategy = _fake_strategy("/device:TPU:0")
    assert jit_rule.resolve_jit_compile(setting, strategy, "float32") == (
        expected,
        f"jit_compile={setting}: as set",
    )


@pytest.mark.parametrize(
    ("setting", "precision", "message"),
    [
        ("yes", "float32", "jit_compile: received 'yes'. Allowed: auto, true, false"),
        (
            "auto",
            "auto",
            "precision: received 'auto'. Allowed: float32, mixed_float16, mixed_bfloat16",
        ),
    ],
)
def test_resolve_jit_compile_rejects_bad_input(setting, precision, message):
    with pytest.raises(UserInputError) as info:
        jit_rule.resolve_jit_compile(setting, tf.distribute.get_strategy(), precision)
    assert str(info.value) == message

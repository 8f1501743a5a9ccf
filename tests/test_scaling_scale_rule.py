"""Tests for mpt_keras.scaling.scale_rule: growth, backoff with hysteresis, floor and ceiling."""

from __future__ import annotations

import keras
import tensorflow as tf

from mpt_keras.backend.tensorflow.cross_replica import Writer
from mpt_keras.scaling.scale_rule import ScaleVariables, back_off, clamped, count_finite_step

GROWTH = dict(growth_factor=2.0, growth_interval=2, max_scale=8.0)
BACKOFF = dict(backoff_factor=0.5, hysteresis=2, min_scale=1.0)


def _variables(scale: float) -> ScaleVariables:
    return ScaleVariables(
        keras.Variable(scale, dtype="float32"),
        keras.Variable(0, dtype="int64"),
        keras.Variable(0, dtype="int64"),
    )


def _state(variables: ScaleVariables) -> tuple[float, int, int]:
    scale, finite_steps, overflows = (v.numpy() for v in variables)
    return float(scale), int(finite_steps), int(overflows)


def test_the_scale_grows_after_growth_interval_finite_steps_up_to_max_scale():
    variables, write = _variables(2.0), Writer(tf.distribute.get_strategy())
    seen = []
    for _ in range(6):
        count_finite_step(write, variables, **GROWTH)
        seen.append(_state(variables))
    assert seen == [(2.0, 1, 0), (4.0, 0, 0), (4.0, 1, 0), (8.0, 0, 0), (8.0, 1, 0), (8.0, 0, 0)]


def test_the_scale_backs_off_from_the_hysteresis_th_overflow_down_to_min_scale():
    variables, write = _variables(4.0), Writer(tf.distribute.get_strategy())
    seen = []
    for _ in range(4):
        back_off(write, variables, **BACKOFF)
        seen.append(_state(variables))
    assert seen == [(4.0, 0, 1), (2.0, 0, 2), (1.0, 0, 2), (1.0, 0, 2)]


def test_a_growth_resets_the_overflow_count():
    variables, write = _variables(4.0), Writer(tf.distribute.get_strategy())
    back_off(write, variables, **BACKOFF)
    count_finite_step(write, variables, **GROWTH)
    count_finite_step(write, variables, **GROWTH)
    assert _state(variables) == (8.0, 0, 0)
    back_off(write, variables, **BACKOFF)
    assert _state(variables) == (8.0, 0, 1)


def test_clamped_keeps_a_scale_within_its_bounds():
    assert [clamped(s, 1.0, 8.0) for s in (0.0, 4.0, 1e9)] == [1.0, 4.0, 8.0]

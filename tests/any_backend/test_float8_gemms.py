"""Our float8 GEMMs on either backend: Keras' numbers under delayed scaling, a NumPy
reference under current scaling, and the equations they take.

One compiled gradient step of a layer alone: its output, the input's and kernel's gradients,
and the float8 state's "gradients" (the values Keras writes into the scales and histories).
"""

import types

import keras
import ml_dtypes
import numpy as np
import pytest

from mpt_keras.backend import current
from mpt_keras.calibration import float8_speed
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.float8_gemms import (
    as_matrix_product,
    einsum_float8,
    install_float8_gemms,
)
from mpt_keras.precision.policies import global_policy

LAYERS = {
    "dense": (lambda: keras.layers.Dense(24, activation="relu"), (4, 8, 16)),
    "query": (
        lambda: keras.layers.EinsumDense("abc,cde->abde", (None, 2, 8), bias_axes="de"),
        (4, 8, 16),
    ),
    "attention_output": (
        lambda: keras.layers.EinsumDense("abcd,cde->abe", (None, 16), bias_axes="e"),
        (4, 8, 2, 8),
    ),
    "kernel_transposed": (lambda: keras.layers.EinsumDense("abc,dc->abd", (None, 12)), (4, 8, 16)),
}


def _layer(name: str, policy: str, recipe: str | None):
    make, shape = LAYERS[name]
    keras.utils.set_random_seed(1)
    x = (np.random.default_rng(0).standard_normal(shape) * 3).astype("float32")
    with global_policy(policy):
        layer = make()
        layer(x)
    layer.quantize("float8")
    if recipe is not None:
        install_float8_gemms(layer, name, recipe)
    return layer, x


def _stepper(layer, x, cotangent):
    """A function of no arguments: `(y, [dx, d each trainable variable])` of
    `sum(y * cotangent)` at the variables' values then, compiled once as a run's step."""
    if current.is_jax():
        import jax

        # Through a model, as a run calls its layers (`__call__` casts the inputs).
        inputs = keras.Input(x.shape[1:])
        model = keras.Model(inputs, layer(inputs))
        fixed = [v.value for v in model.non_trainable_variables]

        def loss(x, trainable):
            y, _ = model.stateless_call(trainable, fixed, x, training=True)
            return keras.ops.sum(keras.ops.cast(y, "float32") * cotangent), y

        compiled = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

        def step():
            (_, y), (dx, grads) = compiled(x, [v.value for v in model.trainable_variables])
            return _array(y), [_array(g) for g in (dx, *grads)]

        return step
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def compiled(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, "float32") * cotangent)
        return y, tape.gradient(loss, [x, *layer.trainable_variables])

    def step():
        y, grads = compiled(tf.constant(x))
        return _array(y), [_array(g) for g in grads]

    return step


def _array(value):
    return np.asarray(keras.ops.convert_to_numpy(value), dtype="float32")


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_delayed_scaling_computes_what_keras_float8_computes(name, policy):
    """Computing in float32: the same numbers. In bfloat16: within a rounding of the largest
    value, our scales multiplying the GEMM's float32 sum, Keras' each bfloat16 operand."""
    keras_layer, x = _layer(name, policy, None)
    ours, _ = _layer(name, policy, "delayed")
    cotangent = np.random.default_rng(2).standard_normal(keras_layer(x).shape).astype("float32")
    keras_step, our_step = (_stepper(layer, x, cotangent) for layer in (keras_layer, ours))
    for _ in range(2):  # The second step scales by what the first step's history gave.
        expected_y, expected = keras_step()
        y, grads = our_step()
        for value, reference in zip([y, *grads], [expected_y, *expected], strict=True):
            if policy == "float32":
                np.testing.assert_array_equal(value, reference)
            else:
                tolerance = 2.0**-7 * float(np.max(np.abs(reference), initial=0.0))
                np.testing.assert_allclose(value, reference, rtol=0, atol=tolerance)
        for layer in (keras_layer, ours):
            for variable, value in zip(layer.trainable_variables, expected[1:], strict=True):
                if variable.overwrite_with_gradient:
                    variable.assign(value)


def _float8(values, scale, dtype):
    largest = float(ml_dtypes.finfo(dtype).max)
    quantized = np.clip(values / scale, -largest, largest).astype(dtype)
    return quantized.astype("float32") * scale


def test_current_scaling_takes_each_tensors_scale_from_its_own_amax():
    layer, x = _layer("dense", "float32", "current")
    layer.activation = None
    layer.use_bias = False
    layer.bias = None
    kernel = np.asarray(keras.ops.convert_to_numpy(layer.kernel))
    cotangent = (np.random.default_rng(2).standard_normal((4, 8, 24)) * 1e-3).astype("float32")
    y, grads = _stepper(layer, x, cotangent)()

    scales = {
        "inputs": np.float32(np.abs(x).max() / np.float32(448.0)),
        "kernel": np.float32(np.abs(kernel).max() / np.float32(448.0)),
        "outputs_grad": np.float32(np.abs(cotangent).max() / np.float32(57344.0)),
    }
    x_2d = _float8(x.reshape(32, 16), scales["inputs"], "float8_e4m3fn")
    k = _float8(kernel, scales["kernel"], "float8_e4m3fn")
    g = _float8(cotangent.reshape(32, 24), scales["outputs_grad"], "float8_e5m2")
    by_name = dict(zip([v.name for v in layer.trainable_variables], grads[1:], strict=True))
    # float32 sums in XLA's order, not NumPy's: equal to a millionth of the largest value.
    for value, reference in (
        (y, (x_2d @ k).reshape(4, 8, 24)),
        (grads[0], (g @ k.T).reshape(x.shape)),
        (by_name["kernel"], x_2d.T @ g),
    ):
        np.testing.assert_allclose(value, reference, rtol=0, atol=1e-6 * np.abs(reference).max())
    amax = {"inputs": np.abs(x).max(), "kernel": np.abs(kernel).max()}
    amax["outputs_grad"] = np.abs(cotangent).max()
    for tensor, scale in scales.items():
        assert by_name[f"{tensor}_scale"] == pytest.approx(scale, rel=1e-6)
        history = by_name[f"{tensor}_amax_history"]
        assert history[0] == pytest.approx(amax[tensor], rel=1e-6)
        assert not history[1:].any()


@pytest.mark.parametrize(
    "equation, product",
    [
        ("ab,bc->ac", ("ab", "bc", "ac", "a", "b", "c")),
        ("abc,cde->abde", ("abc", "cde", "abde", "ab", "c", "de")),
        ("abcd,cde->abe", ("abcd", "cde", "abe", "ab", "cd", "e")),
        ("abc,dc->abd", ("abc", "dc", "abd", "ab", "c", "d")),
        ("abc,acd->abd", None),  # `a` in all three terms: a batch dimension.
        ("abc,cd->abcd", None),  # Nothing contracted.
        ("aab,bc->ac", None),  # A repeated index.
    ],
)
def test_which_equations_are_one_matrix_product(equation, product):
    assert as_matrix_product(equation) == product


def test_an_equation_with_a_batch_dimension_is_refused_in_one_line():
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((3, 4), batch_size=2)
        outputs = keras.layers.EinsumDense("abc,acd->abd", (3, 5), name="batched")(inputs)
        model = keras.Model(inputs, outputs)
    with pytest.raises(UserInputError, match="^layer 'batched': its equation 'abc,acd->abd'"):
        to_float8(model, ["batched"])
    assert model.get_layer("batched").quantization_mode is None  # Checked before any change.


def test_an_unknown_recipe_is_refused_with_the_allowed_ones():
    layer, _ = _layer("dense", "float32", None)
    with pytest.raises(UserInputError, match="^float8 recipe: received 'just_in_time'. Allowed"):
        install_float8_gemms(layer, "dense", "just_in_time")


def test_lora_is_refused_at_the_install_and_when_enabled_after_it():
    with global_policy("float32"):
        layer = keras.layers.Dense(4, name="adapted")
        layer(np.ones((2, 3), "float32"))
    layer.enable_lora(2)
    layer.quantize("float8")
    with pytest.raises(UserInputError) as raised:
        install_float8_gemms(layer, "block/adapted", "delayed")
    assert str(raised.value) == (
        "layer 'block/adapted': float8 GEMMs with LoRA enabled. Allowed: LoRA off"
    )
    installed, x = _layer("dense", "float32", "delayed")
    installed.enable_lora(2)
    # Keras adds the call's arguments to the message on some backends: the first line is ours.
    with pytest.raises(UserInputError, match="layer 'dense': float8 GEMMs with LoRA enabled"):
        installed(x)


def test_an_equation_that_is_no_matrix_product_is_refused_by_einsum_float8():
    tensors = ("inputs", "kernel", "outputs_grad")
    state = {tensor: (1.0, np.zeros(4, "float32")) for tensor in tensors}
    with pytest.raises(UserInputError) as raised:
        einsum_float8("abc,acd->abd", np.ones((2, 3, 4)), np.ones((2, 4, 5)), state, "delayed")
    assert str(raised.value) == "equation 'abc,acd->abd': not a matrix product"


def test_gemm_seconds_is_each_programs_median_after_its_compile(monkeypatch):
    """Timed on a scripted clock: each program's first call (its compile) left out, the two
    timed alternately, each figure the median of its own calls (not a speed claim: this
    machine emulates float8)."""
    # Per repeat after the first: the wide program's call takes 1, 9, 2, 8, 3 s; the float8
    # one's 40, 10, 50, 20, 30 s. The compiles' calls are read once each (no end time).
    assert float8_speed.REPEATS == 5
    durations = ([1, 9, 2, 8, 3], [40, 10, 50, 20, 30])
    readings = [0.0, 0.0]  # The compiles' start times.
    now = 1000.0
    for repeat in range(float8_speed.REPEATS):
        for program in durations:
            readings += [now, now + program[repeat]]
            now += 100
    clock = iter(readings)
    monkeypatch.setattr(
        float8_speed, "time", types.SimpleNamespace(perf_counter=lambda: next(clock))
    )
    assert float8_speed.gemm_seconds((8, 16, 32), "float32") == (3, 30)
    assert next(clock, None) is None  # Every reading taken.

"""Tests of telemetry.diagnosis: the first non-finite output or gradient, in calibration too."""

import keras
import numpy as np
import pytest
from toy_layers import Times

import mpt_keras
from mpt_keras.calibration.calibrate import calibrate
from mpt_keras.calibration.result import format_calibration_table
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.float8 import to_float8
from mpt_keras.telemetry import diagnosis
from mpt_keras.telemetry.diagnosis import NonfiniteReport, describe_for_log, diagnose_nonfinite

# Through a Dense with the identity kernel, `boom` (x 1e4, float16) gets
# [0.5, 8] and makes [5000, 80000]: 80000 is above the float16 max, 65504.
OVERFLOWING = np.array([[0.5, 8.0]], "float32")
FINITE = np.array([[0.5, 1.0]], "float32")
BOOM = NonfiniteReport(
    first_layer="boom", compute_dtype="float16", input_max=8.0, output_max=5000.0
)


class Holder(keras.layers.Layer):
    """A layer holding `boom`: a layer inside a layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.boom = Times(1e4, name="boom")

    def call(self, inputs):
        return self.boom(inputs) + 1.0


class Root(keras.layers.Layer):
    """Adds sqrt(offset), offset 0: a finite output whose gradient for offset is inf."""

    def build(self, input_shape):
        self.offset = self.add_weight(shape=input_shape[-1:], initializer="zeros", name="offset")

    def call(self, inputs):
        return inputs + keras.ops.sqrt(self.offset)


class Raising(keras.layers.Layer):
    """Raises when called on a batch (its output shape is known without a call)."""

    def call(self, inputs):
        raise ValueError("raised by the layer")

    def compute_output_shape(self, input_shape):
        return input_shape


class SubclassedNet(keras.Model):
    """A subclassed model: Dense (identity), then `boom`, or its own x 1e4 without one."""

    def __init__(self, with_boom=True, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, kernel_initializer="identity", name="dense")
        self.boom = Times(1e4, name="boom") if with_boom else None

    def call(self, inputs):
        hidden = self.dense(inputs)
        return self.boom(hidden) if self.boom else hidden * 1e4


def _dense(**kwargs):
    return keras.layers.Dense(2, kernel_initializer="identity", name="dense", **kwargs)


def _head():
    return keras.layers.Dense(1, kernel_initializer="ones", name="head", dtype="float32")


def _functional(*middle, policy="mixed_float16", dense_dtype=None):
    """dense -> each of `middle` (functions making a layer, called under `policy`) -> head."""
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((2,))
    x = _dense(dtype=dense_dtype)(inputs)
    for make_layer in middle:
        x = make_layer()(x)
    return keras.Model(inputs, _head()(x), name="net")


def _subclassed():
    keras.config.set_dtype_policy("mixed_float16")
    return SubclassedNet(name="net")


def _boom_in_a_sub_model():
    keras.config.set_dtype_policy("mixed_float16")
    inner_inputs = keras.Input((2,))
    inner = keras.Model(inner_inputs, Times(1e4, name="boom")(inner_inputs), name="inner")
    return keras.Sequential([keras.Input((2,)), _dense(), inner, _head()], name="net")


@pytest.mark.parametrize(
    "build, path",
    [
        (lambda: _functional(lambda: Times(1e4, name="boom")), "boom"),
        (_boom_in_a_sub_model, "inner/boom"),
        (lambda: _functional(lambda: Holder(name="holder")), "holder/boom"),
        (_subclassed, "boom"),
    ],
    ids=["functional", "sub_model_in_a_sequential", "layer_in_a_layer", "subclassed"],
)
def test_a_float16_overflow_names_its_layer_by_path(build, path):
    model = build()
    report = diagnose_nonfinite(model, OVERFLOWING)
    assert report == NonfiniteReport(
        first_layer=path, compute_dtype="float16", input_max=8.0, output_max=5000.0
    )
    assert str(report) == f"first non-finite output: {path} (float16), input max 8"
    assert report.summary() == str(report)
    assert not report.finite
    # The same model on a batch that fits float16.
    assert diagnose_nonfinite(model, FINITE) == NonfiniteReport()


def test_a_finite_batch_names_nothing():
    report = diagnose_nonfinite(_functional(lambda: Times(1e4, name="boom")), FINITE)
    assert report == NonfiniteReport()
    assert report.finite
    assert str(report) == "all outputs finite"


def test_a_float32_output_too_large_for_float16_names_the_layer_it_feeds_with_its_input():
    """`boom` (x 1, float16) is called with 1e5 in float32: the cast to float16 overflows."""
    model = _functional(lambda: Times(1.0, name="boom"), dense_dtype="float32")
    report = diagnose_nonfinite(model, np.array([[1e5, 3.0]], "float32"))
    assert report == NonfiniteReport(
        first_layer="boom", compute_dtype="float16", input_max=1e5, output_max=3.0
    )
    assert str(report) == "first non-finite output: boom (float16), input max 1e+05"


def test_non_finite_inputs_are_said_to_be_passed_on():
    model = _functional(lambda: Times(1e4, name="boom"))
    report = diagnose_nonfinite(model, np.array([[0.5, np.nan]], "float32"))
    assert report == NonfiniteReport(
        first_layer="dense",
        compute_dtype="float16",
        input_max=0.5,
        output_max=None,  # 0.5 x 1 + NaN x 0 is NaN too.
        inputs_finite=False,
        weight_max=1.0,  # Not shown: the cause lies upstream.
    )
    assert str(report) == (
        "first non-finite output: dense (float16), input max 0.5, its inputs already non-finite"
    )


def test_the_models_own_code_is_named_by_the_models_name():
    keras.config.set_dtype_policy("mixed_float16")
    report = diagnose_nonfinite(SubclassedNet(with_boom=False, name="net"), OVERFLOWING)
    assert report == NonfiniteReport(
        first_layer="net",
        compute_dtype="float16",
        input_max=8.0,
        output_max=5000.0,
        weight_max=1.0,  # Its weights: the identity kernel of its Dense.
    )
    assert str(report) == "first non-finite output: net (float16), input max 8, weight max 1"


def _root_model(**compile_arguments):
    """dense (identity) -> root -> head (ones): [1, 2] gives 3, so loss (3 - 1)^2 = 4."""
    model = _functional(lambda: Root(name="root"), policy="float32")
    if compile_arguments:
        model.compile(**compile_arguments)
    return model


def test_a_finite_forward_pass_whose_gradient_is_not_finite_names_the_variable():
    model = _root_model(optimizer="sgd", loss="mse")
    assert [variable.path for variable in model.trainable_variables] == [
        "dense/kernel", "dense/bias", "root/offset", "head/kernel", "head/bias"
    ]  # fmt: skip
    report = diagnose_nonfinite(model, np.array([[1.0, 2.0]], "float32"), np.array([[1.0]]))
    assert report == NonfiniteReport(first_nonfinite_gradient="root/offset", loss=4.0)
    assert str(report) == "first non-finite gradient: root/offset"
    assert not report.finite


def test_a_given_loss_replaces_the_compiled_one_and_weighs_the_samples():
    model = _root_model()
    features = np.array([[1.0, 2.0], [1.0, 1.0]], "float32")
    report = diagnose_nonfinite(
        model,
        features,
        np.array([[1.0], [1.0]]),
        sample_weight=np.array([1.0, 0.0]),
        loss=keras.losses.MeanSquaredError(),
    )
    # (3 - 1)^2 weighed 1 and (2 - 1)^2 weighed 0, over 2 examples.
    assert report == NonfiniteReport(first_nonfinite_gradient="root/offset", loss=2.0)


@pytest.mark.parametrize(
    "initial_scale, expected",
    [
        (1.0, NonfiniteReport(loss=9.0)),
        (2.0**24, NonfiniteReport(first_nonfinite_gradient="dense/kernel", loss=9.0 * 2**24)),
    ],
)
def test_the_gradients_are_of_the_loss_times_the_optimizers_scale(initial_scale, expected):
    """dense is float16: the loss's gradient times 2**24 overflows float16 on its way back."""
    model = _functional(policy="mixed_float16")
    optimizer = mpt_keras.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=initial_scale)
    model.compile(optimizer=optimizer, loss="mse")
    report = diagnose_nonfinite(model, np.array([[1.0, 2.0]], "float32"), np.array([[0.0]]))
    assert report == expected
    assert str(report) == (
        "all outputs and gradients finite"
        if expected.finite
        else "first non-finite gradient: dense/kernel"
    )
    assert optimizer.loss_scale == initial_scale
    assert int(optimizer.iterations) == 0


def test_a_non_finite_loss_is_said():
    report = NonfiniteReport(first_nonfinite_gradient="dense/kernel", loss=float("inf"))
    assert str(report) == "first non-finite gradient: dense/kernel, loss inf"
    assert str(NonfiniteReport(loss=float("nan"))) == "all outputs finite, loss nan"
    assert not NonfiniteReport(loss=float("nan")).finite


def test_a_non_finite_forward_pass_takes_no_gradient():
    model = _functional(lambda: Times(1e4, name="boom"))
    model.compile(optimizer="sgd", loss="mse")
    assert diagnose_nonfinite(model, OVERFLOWING, np.array([[0.0]])) == BOOM


def test_targets_without_a_loss_are_an_error():
    with pytest.raises(UserInputError) as raised:
        diagnose_nonfinite(_root_model(), FINITE, np.array([[0.0]]))
    assert str(raised.value) == (
        "diagnose_nonfinite y: received targets for model 'net', which is not compiled (no "
        "loss to take gradients of). Allowed: a compiled model, or loss="
    )


def test_keras_layer_call_is_put_back_and_the_layers_are_untouched():
    layer_call = vars(keras.layers.Layer)["__call__"]
    model = _functional(lambda: Holder(name="holder"))
    own_call = model.get_layer("head").call  # A layer's own `call`, set on the instance.
    model.get_layer("head").call = own_call
    diagnose_nonfinite(model, OVERFLOWING)
    assert vars(keras.layers.Layer)["__call__"] is layer_call
    assert vars(model.get_layer("head"))["call"] is own_call
    assert [path for path, layer in iter_layers(model) if "call" in vars(layer)] == ["head"]


def test_keras_layer_call_is_put_back_when_the_forward_pass_raises():
    layer_call = vars(keras.layers.Layer)["__call__"]
    model = _functional(lambda: Raising(name="raising"))
    with pytest.raises(ValueError, match="raised by the layer"):
        diagnose_nonfinite(model, FINITE)
    assert vars(keras.layers.Layer)["__call__"] is layer_call
    # And the next diagnosis records afresh.
    assert diagnose_nonfinite(_functional(lambda: Times(1e4, name="boom")), OVERFLOWING) == BOOM


def test_a_keras_hub_backbones_attention_is_named_by_its_path(tiny_gpt2):
    keras.config.set_dtype_policy("mixed_float16")
    backbone = tiny_gpt2()
    inputs = {
        "token_ids": np.array([[1, 2, 3, 4]], "int32"),
        "padding_mask": np.ones((1, 4), bool),
    }
    assert diagnose_nonfinite(backbone, inputs) == NonfiniteReport()
    # The second block's query projection multiplies each feature by 6e4:
    # its layer-normalized inputs reach above 65504 / 6e4 = 1.09.
    query = dict(iter_layers(backbone))["transformer_layer_1/self_attention/query"]
    query.kernel.assign(6e4 * np.eye(16).reshape(query.kernel.shape))
    report = diagnose_nonfinite(backbone, inputs)
    assert report.first_layer == "transformer_layer_1/self_attention/query"
    assert report.compute_dtype == "float16"
    assert report.inputs_finite
    assert report.input_max * 6e4 > 65504
    assert report.weight_max == 6e4
    assert str(report) == (
        "first non-finite output: transformer_layer_1/self_attention/query (float16), "
        f"input max {report.input_max:.2g}, weight max 6e+04"
    )


def test_describe_for_log_is_one_line_with_the_step():
    assert (
        describe_for_log(412, BOOM)
        == "step 412: first non-finite output: boom (float16), input max 8"
    )
    assert describe_for_log(3, NonfiniteReport()) == "step 3: all outputs finite"


def test_the_package_exports_the_diagnosis():
    assert mpt_keras.diagnose_nonfinite is diagnosis.diagnose_nonfinite
    assert mpt_keras.NonfiniteReport is diagnosis.NonfiniteReport


# Calibration (float32) of a batch that is not finite in float32.

# Through dense (identity) and head (ones) each example gives 3.
CALIBRATION_DATA = (np.array([[1.0, 2.0], [2.0, 1.0]], "float32"), np.array([[1.0], [1.0]]))


def test_calibration_of_a_non_finite_float32_output_is_an_error_naming_the_layer():
    model = _functional(
        lambda: Times(1e38, name="boom"), lambda: Times(1e38, name="bang"), policy="float32"
    )
    with pytest.raises(UserInputError) as raised:
        calibrate(model, CALIBRATION_DATA, keras.losses.MeanSquaredError(), steps=2, batch_size=1)
    assert str(raised.value) == (
        "statistics batch 1 of 2 is not finite in float32: first non-finite output: bang "
        "(float32), input max 2e+38. Allowed: a model and data whose float32 outputs are finite"
    )


def test_calibration_names_the_first_non_finite_gradient_in_its_statistics_and_table():
    result = calibrate(
        _root_model(), CALIBRATION_DATA, keras.losses.MeanSquaredError(), steps=2, batch_size=1
    )
    line = "statistics batch 1 of 2: first non-finite gradient: root/offset"
    assert result.statistics["diagnosis"] == line
    table = format_calibration_table(result.statistics).splitlines()
    assert table[0].split()[0] == "path"
    assert [row.split()[0] for row in table[1:-1]] == ["dense", "root", "head"]
    assert table[-1] == line


def test_calibration_of_finite_batches_has_no_diagnosis_line():
    model = _functional(lambda: Times(2.0, name="double"), policy="float32")
    result = calibrate(
        model, CALIBRATION_DATA, keras.losses.MeanSquaredError(), steps=2, batch_size=1
    )
    assert result.statistics["diagnosis"] is None
    table = format_calibration_table(result.statistics).splitlines()
    assert [row.split()[0] for row in table] == ["path", "dense", "double", "head"]


def test_a_float8_model_is_diagnosed_gradients_included():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    to_float8(model, ["hidden"])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((2, 4), np.float32)
    report = diagnose_nonfinite(model, x, np.full((2, 2), np.inf, np.float32))
    assert report.first_layer is None
    assert report.first_nonfinite_gradient == "hidden/kernel"

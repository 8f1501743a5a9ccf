"""The float8 census on either backend: a compiled train step's GEMMs, each float8 layer's found.

A backbone (a model of its own) holds two float8 layers under a head that stays bfloat16: its
first Dense (no input gradient: its inputs are the data) and an EinsumDense. On a CPU no
float8 GEMM exists, so each is `emulated`; the same program judged as on a float8-capable
GPU makes each a `fallback`, with a warning naming the layer and the GEMM. Which wider type a
CPU's dot runs in (bfloat16 or float32) is XLA's choice per CPU, so it is not pinned.
"""

import logging

import keras
import numpy as np
import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.float8_census import take_census
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.policies import global_policy

HOPPER = HardwareProbe(gpu_compute_capabilities=((9, 0),))
# Tokens (4 x 6 = 24) unlike every width, so each gradient GEMM's role shows in its shape.
ROLES = [
    ("backbone/up", "forward"),
    ("backbone/up", "weight gradient"),
    ("backbone/down", "forward"),
    ("backbone/down", "input gradient"),
    ("backbone/down", "weight gradient"),
]


@pytest.fixture(scope="module")
def model_and_batch():
    keras.utils.set_random_seed(0)
    with global_policy("mixed_bfloat16"):
        inner = keras.Input((6, 8))
        hidden = keras.layers.Dense(16, name="up")(inner)
        hidden = keras.layers.EinsumDense("btd,dh->bth", output_shape=(6, 12), name="down")(hidden)
        backbone = keras.Model(inner, hidden, name="backbone")
        inputs = keras.Input((6, 8))
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)))
        to_float8(model, ["backbone/up", "backbone/down"])
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(4, 6, 8)).astype("float32"),
        rng.normal(size=(4, 6, 3)).astype("float32"),
    )
    return model, batch


def test_each_float8_gemm_on_a_cpu_is_emulated(model_and_batch):
    census = take_census(*model_and_batch, probe=HardwareProbe())
    assert [(row.layer, row.gemm) for row in census.rows] == ROLES
    assert {row.verdict for row in census.rows} == {"emulated"}
    assert {row.runs_in for row in census.rows} <= {"bfloat16", "float32"}
    assert census.unseen == ()
    assert census.summary() == (
        "emulated: 0 of 5 GEMMs of 2 float8 layers run in float8 "
        "(no GPU: this machine has no float8 matmul units)"
    )
    assert census.format_table().splitlines()[1].split() == [
        "layer",
        "gemm",
        "runs_in",
        "kernel",
        "verdict",
    ]


def test_on_a_float8_device_a_wider_gemm_is_a_fallback_and_a_warning(model_and_batch, caplog):
    with caplog.at_level(logging.WARNING, logger="mpt_keras.precision.float8_census"):
        census = take_census(*model_and_batch, probe=HOPPER)
    assert [row.verdict for row in census.rows] == ["fallback"] * 5
    assert census.summary().startswith("fallback: 0 of 5 GEMMs of 2 float8 layers")
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 5
    assert warned[3].startswith("Float8 layer backbone/down: its input gradient GEMM runs in ")


def test_without_xla_nothing_compiles_and_every_layer_is_emulated(model_and_batch):
    census = take_census(*model_and_batch, probe=HOPPER, xla=False)
    assert (census.float8_gemms, census.rows, census.unseen) == (
        False,
        (),
        ("backbone/up", "backbone/down"),
    )
    assert "only XLA's GEMM rewrite reaches them and XLA is off" in census.reason


def test_the_census_leaves_the_layers_calls_as_they_were(model_and_batch):
    model, batch = model_and_batch
    take_census(model, batch, probe=HardwareProbe())
    up = model.get_layer("backbone").get_layer("up")
    assert "quantized_call" not in vars(up) and "call" not in vars(up)


def test_after_fit_every_gemm_is_found_as_before(model_and_batch):
    # Keras' JAX trainer jits the model's own `train_step`; a census that lowered it again
    # would get that trace back, made before the census scoped each float8 layer's calls.
    model, (x, y) = model_and_batch
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    census = take_census(model, (x, y), probe=HardwareProbe())
    assert [(row.layer, row.gemm) for row in census.rows] == ROLES
    assert census.unseen == ()


def test_an_uncompiled_model_is_one_line():
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(4, name="up")(inputs), name="mine")
        to_float8(model, ["up"])
    with pytest.raises(UserInputError) as raised:
        take_census(model, (np.ones((2, 8)), np.ones((2, 4))))
    assert str(raised.value) == (
        "float8 census: received model 'mine', which is not compiled (no train step to "
        "compile). Allowed: a model compiled with its optimizer and loss (model.compile)"
    )


@pytest.mark.parametrize("alone", [lambda x: x, lambda x: (x,)], ids=["array", "tuple"])
def test_inputs_alone_for_a_model_with_a_loss_are_one_line(model_and_batch, alone):
    model, (x, _) = model_and_batch
    with pytest.raises(UserInputError) as raised:
        take_census(model, alone(x))
    assert str(raised.value) == (
        f"float8 census batch: received inputs alone, no targets, for model '{model.name}' "
        "compiled with a loss. Allowed: (x, y) or (x, y, sample_weight), one batch as fit "
        "takes it"
    )


def test_a_model_that_runs_without_xla_is_emulated_unless_told_otherwise():
    # What `fit` runs: Keras' step without XLA holds no float8 GEMM, whatever the device.
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(4, name="up")(inputs))
        to_float8(model, ["up"])
        model.compile(optimizer="adam", loss="mse", jit_compile=False)
    batch = (np.ones((2, 8), "float32"), np.ones((2, 4), "float32"))
    census = take_census(model, batch, probe=HOPPER)
    assert (census.state, census.rows, census.unseen) == ("emulated", (), ("up",))
    assert "XLA is off" in census.reason
    told = take_census(model, batch, probe=HOPPER, xla=True)
    assert [(row.layer, row.gemm, row.verdict) for row in told.rows] == [
        ("up", "forward", "fallback"),
        ("up", "weight gradient", "fallback"),
    ]

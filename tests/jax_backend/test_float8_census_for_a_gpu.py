"""The float8 census of a train step compiled for an H100, on this CPU: XLA's own GPU compiler
run without the device (JAX's CUDA plugin; `backend/jax/gpu_targets.py`), the program an H100
would run before autotuning, read as on one.

Two float8 Dense layers under a bfloat16 head, on `[batch, tokens, width]` inputs, trained by
our optimizer. Ours: each GEMM a Triton GEMM of float8 operands, 5 of 5. Keras' own float8
(`quantize("float8")` alone): each a bfloat16 Triton GEMM, XLA having dropped the round trip
through float8 (`simplify-fp-conversions`), 0 of 5: a fallback and a warning each. XLA's
version decides this (the test extra pins jax with its plugin). Of the suite's XLA flags
(tests/conftest.py) only `--xla_backend_optimization_level=0` reaches a GPU compile (the others
are the CPU backend's); it leaves these programs' GEMMs as they are without it (the same
kernels, types and shapes, 2026-12-04).
"""

import json
import logging
import os
import re

import jax
import jaxlib
import keras
import numpy as np
import pytest
from launchers import launch_in_process

import mpt_keras
from mpt_keras.backend.jax import gpu_targets
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.float8_census import take_census
from mpt_keras.precision.policies import global_policy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REASON = "compiled for h100, no autotuning: GPU compute capability 9.0 and XLA: float8 tensor cores"
ROLES = [
    ("up", "forward"),  # The first layer: its inputs are the data, no input gradient.
    ("up", "weight gradient"),
    ("down", "forward"),
    ("down", "input gradient"),
    ("down", "weight gradient"),
]


def _model_and_batch(ours: bool):
    keras.utils.set_random_seed(0)
    with global_policy("mixed_bfloat16"):
        inputs = keras.Input((32, 64))
        hidden = keras.layers.Dense(128, activation="gelu", name="up")(inputs)
        hidden = keras.layers.Dense(64, name="down")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(16, name="head")(hidden))
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(8, 32, 64)).astype("float32"),
        rng.normal(size=(8, 32, 16)).astype("float32"),
    )
    model(batch[0][:1])
    if ours:
        to_float8(model, ["up", "down"])
    else:
        for name in ("up", "down"):
            model.get_layer(name).quantize("float8")
    optimizer = mpt_keras.LossScaleOptimizer(keras.optimizers.AdamW(1e-3))
    model.compile(optimizer=optimizer, loss="mse")
    return model, batch


def test_our_float8_gemms_compiled_for_an_h100_are_each_a_float8_triton_gemm():
    census = take_census(*_model_and_batch(ours=True), target="h100")
    assert [(r.layer, r.gemm, r.runs_in, r.kernel, r.verdict) for r in census.rows] == [
        (layer, gemm, "float8", "triton gemm", "float8") for layer, gemm in ROLES
    ]
    assert census.summary() == f"float8: 5 of 5 GEMMs of 2 float8 layers run in float8 ({REASON})"


def test_keras_own_float8_compiled_for_an_h100_runs_in_bfloat16_with_a_warning_each(caplog):
    with caplog.at_level(logging.WARNING, logger="mpt_keras.precision.float8_census"):
        census = take_census(*_model_and_batch(ours=False), target="h100")
    assert [(r.layer, r.gemm, r.runs_in, r.kernel, r.verdict) for r in census.rows] == [
        (layer, gemm, "bfloat16", "triton gemm", "fallback") for layer, gemm in ROLES
    ]
    assert census.summary() == f"fallback: 0 of 5 GEMMs of 2 float8 layers run in float8 ({REASON})"
    assert len(caplog.records) == 5


def test_xla_drops_keras_float8_rounding_for_an_h100_and_keeps_ours():
    """Compiled for an H100, Keras' float8 step holds no float8 value at all (the round trips
    `simplify-fp-conversions` removed, the GEMMs taking the bfloat16 values); ours quantizes
    the two inputs and kernels and the two output gradients, each in its format."""
    from mpt_keras import compat
    from mpt_keras.backend.jax.compiled import train_step_hlo

    programs = {}
    for ours in (False, True):
        model, batch = _model_and_batch(ours)
        compat.symbolic_build(model, batch)
        programs[ours] = train_step_hlo(model, batch, "h100")
    assert re.findall(r"\bf8e(?:4m3fn|5m2)\[", programs[False]) == []
    converts = re.findall(r"= (f8e4m3fn|f8e5m2)\[[\d,]*\]\S* (?:convert|fusion)\(", programs[True])
    assert sorted(set(converts)) == ["f8e4m3fn", "f8e5m2"]


def test_mpt_train_dry_run_takes_the_census_for_an_h100(tmp_path):
    override = json.dumps(
        {
            "model": {"options": {"num_layers": 1, "d_model": 16, "num_heads": 2}},
            "data": {"sequence_length": 16, "eval_examples": 8},
        }
    )
    result = launch_in_process(
        "mpt-train",
        f"--config={os.path.join(REPO, 'configs', 'python_source_transformer.json')}",
        "--manifest="
        + os.path.join(REPO, "configs", "manifests", "python_source_transformer_float8.json"),
        f"--config_override={override}",
        f"--model_dir={tmp_path / 'run'}",
        "--dry_run",
        "--census_target=h100",
    )
    assert result.status == 0, result.stderr
    summary, header, *gemms = result.stdout.split("\nfloat8 census, ")[1].splitlines()
    assert summary == f"float8: 18 of 18 GEMMs of 6 float8 layers run in float8 ({REASON})"
    assert [row.split()[-2:] for row in gemms] == [["gemm", "float8"]] * 18
    assert not (tmp_path / "run").exists()


def test_without_xla_nothing_is_compiled_for_the_target_and_every_layer_is_emulated():
    census = take_census(*_model_and_batch(ours=True), target="h100", xla=False)
    assert (census.rows, census.unseen) == ((), ("up", "down"))
    assert census.summary() == (
        "emulated: 0 of 0 GEMMs of 2 float8 layers run in float8; no GEMM found for 2 of the "
        "layers (h100, not compiled: GPU "
        "compute capability 9.0 has float8 tensor cores, but only XLA's GEMM rewrite reaches "
        "them and XLA is off)"
    )


def test_an_unknown_target_is_refused_in_one_line():
    with pytest.raises(UserInputError) as raised:
        take_census(*_model_and_batch(ours=True), target="a100")
    assert str(raised.value) == "GPU target: received 'a100'. Allowed: h100, h200"


def test_without_the_cuda_plugin_the_census_says_what_to_install(monkeypatch):
    from jax.experimental import topologies

    def no_plugin(*args, **kwargs):
        raise RuntimeError("Unknown backend: 'cuda' requested, but no platforms are available.")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    gpu_targets.compile_only_device.cache_clear()
    try:
        with pytest.raises(UserInputError) as raised:
            gpu_targets.compile_only_device("h100")
    finally:
        gpu_targets.compile_only_device.cache_clear()
    assert str(raised.value) == (
        "compiling for GPU target 'h100': no CUDA compile-only topology (Unknown backend: "
        "'cuda' requested, but no platforms are available.). It needs JAX's CUDA plugin of "
        f"this jaxlib's version: pip install jax-cuda13-plugin=={jaxlib.__version__}"
    )


def test_without_ptxas_the_census_says_where_to_get_it(monkeypatch):
    class Unbuildable:
        def __init__(self, function):
            pass

        def lower(self, *args):
            return self

        def compile(self):
            raise jax.errors.JaxRuntimeError(
                "INTERNAL: ptxas_version: Couldn't find a suitable version of ptxas."
            )

    monkeypatch.setattr(jax, "jit", Unbuildable)
    with pytest.raises(UserInputError) as raised:
        gpu_targets.optimized_hlo(lambda x: x, (np.ones(2, "float32"),), "h100")
    assert str(raised.value) == (
        "compiling for GPU target 'h100' needs CUDA's ptxas: none found (install a CUDA "
        "toolkit, or pip install nvidia-cuda-nvcc)"
    )


def test_each_target_is_a_device_xla_compiles_for():
    from mpt_keras.backend.names import GPU_TARGETS

    kinds = [gpu_targets.compile_only_device(target).device_kind for target in GPU_TARGETS]
    assert kinds == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    for target in GPU_TARGETS:  # XLA's GPU compiler ran: its fusions carry a GPU's config.
        hlo = gpu_targets.optimized_hlo(lambda x: x * 2, (np.ones(4, "float32"),), target)
        assert "kind=kLoop" in hlo and '"operation_queue_id"' in hlo

"""mpt-bench runs (at a tiny size), reports every field, and counts FLOPs exactly.

The benchmark suite is not a timed test: these tests check that it runs and
what it writes, never how fast anything was. The full run is the installed
`mpt-bench` in its own process; the bad flags run its entry point in this one
(tests/launchers.py).
"""

import json
import math
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf
from launchers import launch_console_script, launch_in_process
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from benchmarks import (
    auto_choice,
    chart,
    float8_variants,
    flops,
    harness,
    measuring,
    op_profile,
    suite,
    suite_report,
    suite_settings,
    variant_records,
    workloads,
)
from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.precision.hardware import HardwareProbe
from mpt_keras.precision.policies import global_policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = (int, float)
RATIO = {"ratio": float, "paired_ratio_median": float}
VARIANT_FIELDS = {
    "model": str,
    "precision": str,
    "compute_dtype": str,
    "xla": bool,
    "stack": str,
    "step_seconds": list,
    "median_step_seconds": float,
    "examples_per_second": float,
    "tokens_per_second": type(None),  # The CNN has no tokens.
    "train_step_flops": int,
    "flops_per_second": float,
    "fraction_of_matmul_peak": float,
    "peak_memory_bytes": int,
    "step_memory_bytes": int,
    "variable_bytes": int,
    "speed": dict,
    "op_profile": (dict, type(None)),  # Profiled with XLA off only.
    "float8": type(None),  # No float8 variant without --float8.
}
PROFILE_FIELDS = {
    "seconds_per_step": dict,
    "fractions": dict,
    "top_ops": dict,
    "trace": str,
    "matmul_speedup_vs_float32": type(None),  # Float32 itself.
    "op_time_speedup_vs_float32": type(None),
    "speedup_with_peak_matmuls": type(None),
}
AUTO_FIELDS = {
    "stack": str,
    "jit_compile": bool,
    "reason": str,
    "step_time_over_best": float,
    "paired_step_time_over_best": float,
    "tolerance": float,
    "within_tolerance": bool,
}


def test_the_launcher_prints_the_table_and_writes_every_field(tmp_path):
    rounds = 2
    arguments = [
        "--models=cnn",
        "--precisions=float32",
        "--xla=off,on",
        "--stacks=ours,stock",
        f"--rounds={rounds}",
        "--steps_per_round=2",
        "--warmup_steps=1",
        "--memory_steps=1",
        "--image_batch_size=4",
        "--matmul_size=32",
        "--matmul_rounds=2",
        "--profile_steps=2",
        f"--output={tmp_path / 'out'}",
    ]
    result = launch_console_script("mpt-bench", *arguments)
    assert result.status == 0, result.stderr
    names = [
        "cnn/float32/xla_off/ours",
        "cnn/float32/xla_off/stock",
        "cnn/float32/xla_on/ours",
        "cnn/float32/xla_on/stock",
    ]
    table_rows = [line.split()[0] for line in result.stdout.splitlines()[1:5]]
    assert table_rows == names
    assert "jit_compile=auto cnn/float32: XLA off; step time" in result.stdout
    assert "op time per step from the TensorFlow profiler" in result.stdout
    assert sorted(os.listdir(tmp_path / "out")) == ["bench.json", "bench.png", "profile"]
    assert sorted(os.listdir(tmp_path / "out" / "profile")) == [
        "cnn-float32-xla_off-ours",
        "cnn-float32-xla_off-stock",
    ]

    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(report) == {
        "benchmark",
        "settings",
        "models",
        "machine",
        "methods",
        "matmul_peak",
        "variants",
        "auto_jit_compile",
        "run",
    }
    assert report["settings"]["xla"] == ["off", "on"]
    assert report["models"] == {"cnn": {"name": "cnn", "input_shape": [8, 8, 1], "batch_size": 4}}
    assert set(report["methods"]) == {
        "step_time",
        "flops",
        "memory",
        "speed_ratio",
        "op_profile",
    }
    assert {"cpu", "cpu_count", "tensorflow", "keras", "devices"} <= set(report["machine"])
    assert set(report["run"]) == {"date", "command", "cpu_flags"}
    assert report["run"]["command"] == " ".join(["mpt-bench", *arguments])

    peak = report["matmul_peak"]
    assert peak["size"] == 32 and peak["flops_per_matmul"] == 2 * 32**3
    assert set(peak["flops_per_second"]) == {"float32", "bfloat16", "float16"}
    assert all(len(times) == 2 for times in peak["step_seconds"].values())
    assert peak["bfloat16_over_float32"] == (
        peak["flops_per_second"]["bfloat16"] / peak["flops_per_second"]["float32"]
    )

    assert list(report["variants"]) == names
    for name, row in report["variants"].items():
        assert set(row) == set(VARIANT_FIELDS), name
        for key, value in row.items():
            allowed = VARIANT_FIELDS[key]
            assert type(value) in (allowed if isinstance(allowed, tuple) else (allowed,)), key
        profile = row["op_profile"]
        assert (profile is None) is row["xla"], name
        if profile is not None:
            assert {key: type(value) for key, value in profile.items()} == PROFILE_FIELDS, name
            assert os.path.isfile(profile["trace"]), name
            seconds = profile["seconds_per_step"]
            assert seconds["total"] == sum(seconds[c] for c in op_profile.CATEGORIES) > 0
            assert seconds["matmul"] > 0, name  # The convolutions and the dense layer.
            assert sum(profile["fractions"].values()) == pytest.approx(1.0)
        assert len(row["step_seconds"]) == rounds
        assert row["examples_per_second"] == 4 / row["median_step_seconds"]
        assert row["flops_per_second"] == row["train_step_flops"] / row["median_step_seconds"]
        assert row["fraction_of_matmul_peak"] == (
            row["flops_per_second"] / peak["flops_per_second"]["float32"]
        )
        expected_ratios = {
            "vs_float32": False,  # Float32 itself.
            "vs_stock": row["stack"] == "ours",
            "vs_no_xla": row["xla"],
            "vs_no_float8": False,
        }
        for key, present in expected_ratios.items():
            ratio = row["speed"][key]
            if present:
                assert {k: type(v) for k, v in ratio.items()} == RATIO, (name, key)
            else:
                assert ratio is None, (name, key)
    stock = report["variants"]["cnn/float32/xla_off/stock"]["median_step_seconds"]
    ours = report["variants"]["cnn/float32/xla_off/ours"]
    assert ours["speed"]["vs_stock"]["ratio"] == stock / ours["median_step_seconds"]

    auto = report["auto_jit_compile"]["cnn/float32"]
    assert {key: type(value) for key, value in auto.items()} == AUTO_FIELDS
    assert auto["stack"] == "ours" and auto["jit_compile"] is False
    assert auto["step_time_over_best"] >= 1.0
    assert auto["tolerance"] == auto_choice.AUTO_TOLERANCE
    assert auto["within_tolerance"] is (auto["step_time_over_best"] <= auto_choice.AUTO_TOLERANCE)

    image = tf.io.decode_png((tmp_path / "out" / "bench.png").read_bytes())
    assert image.shape[2] == 3 and image.shape[1] == 900


def _one_tiny_variant() -> suite_settings.Settings:
    """The MLP in float32, stock, without XLA: one variant, measured as briefly as can be."""
    return suite_settings.Settings(
        models=("mlp",),
        precisions=("float32",),
        xla=("off",),
        stacks=("stock",),
        rounds=1,
        steps_per_round=1,
        warmup_steps=1,
        memory_steps=1,
        image_batch_size=4,
        matmul_size=8,
        matmul_rounds=1,
    )


@pytest.mark.usefixtures("no_memory_statistics")
def test_memory_is_none_where_the_device_keeps_no_statistics():
    result = suite.measure(_one_tiny_variant())
    row = result["variants"]["mlp/float32/xla_off/stock"]
    assert row["peak_memory_bytes"] is None and row["step_memory_bytes"] is None
    assert row["variable_bytes"] > 0
    assert result["methods"]["memory"] == "not measured: TensorFlow tracks no device's memory here"


def test_a_model_whose_flops_cannot_be_counted_is_measured_without_them(monkeypatch):
    def uncountable(model, input_spec):
        raise ValueError("FLOPs need static shapes. Received: x of shape (None, 8)")

    monkeypatch.setattr(flops, "train_step_flops", uncountable)
    result = suite.measure(_one_tiny_variant())
    row = result["variants"]["mlp/float32/xla_off/stock"]
    assert row["train_step_flops"] is row["flops_per_second"] is None
    assert row["fraction_of_matmul_peak"] is None
    assert suite_report.table(result).splitlines()[1].split()[4:6] == ["-", "-"]  # GFLOP/s, %peak
    assert tf.io.decode_png(suite_report.plot(result)).shape[2] == 3  # No bar for it.


EMULATION = (
    "float8 layers quantize their matmuls' operands to float8 and multiply them converted back "
    "to a wider type: extra work, no speed-up"
)
NO_GPU = f"no GPU: this machine has no float8 matmul units; {EMULATION}"


def test_float8_twins_are_measured_beside_their_own_and_labelled_emulated():
    settings = suite_settings.Settings(
        models=("mlp",),
        precisions=("float32", "mixed_bfloat16"),
        xla=("off",),
        stacks=("ours",),
        float8=True,
        rounds=2,
        steps_per_round=1,
        warmup_steps=1,
        memory_steps=1,
        image_batch_size=4,
        matmul_size=8,
        matmul_rounds=1,
    )
    result = suite.measure(settings)
    float32, bfloat16, float8 = (
        "mlp/float32/xla_off/ours",
        "mlp/mixed_bfloat16/xla_off/ours",
        "mlp/mixed_bfloat16+float8/xla_off/ours",
    )
    assert list(result["variants"]) == [float32, bfloat16, float8]
    assert result["float8"]["layers"] == {"mlp": ["dense_0", "dense_1", "logits"]}
    rows = result["variants"]
    twin, row = rows[bfloat16], rows[float8]
    assert (row["precision"], row["compute_dtype"]) == ("mixed_bfloat16", "bfloat16")
    assert row["float8"] == {  # This machine: CPU only; without XLA the census compiles nothing.
        "execution": "emulated",
        "reason": NO_GPU,
        "census": {
            "float8_gemms": False,
            "reason": "no GPU: this machine has no float8 matmul units",
            "state": "emulated",
            "summary": "emulated: 0 of 0 GEMMs of 3 float8 layers run in float8; no GEMM found "
            "for 3 of the layers (no GPU: this machine has no float8 matmul units)",
            "gemms": [],
            "unseen": ["dense_0", "dense_1", "logits"],
        },
    }
    assert twin["float8"] is None and twin["speed"]["vs_no_float8"] is None
    assert row["speed"]["vs_no_float8"] == harness.ratio(twin["step_seconds"], row["step_seconds"])
    assert row["speed"]["vs_float32"] == harness.ratio(
        rows[float32]["step_seconds"], row["step_seconds"]
    )
    assert row["variable_bytes"] > twin["variable_bytes"]  # Scales and amax histories.

    lines = suite_report.table(result).splitlines()
    assert [line.split("  ")[0] for line in lines[1:4]] == [
        float32,
        bfloat16,
        f"{float8} (emulated)",
    ]
    assert lines[5] == (
        "float8 variants (Dense and EinsumDense layers in float8: mlp 3): examples/s over the "
        "same variant without float8"
    )
    assert lines[6].startswith(f"{float8} (emulated) ")
    # Slower, unless this tiny model's two rounds say otherwise.
    assert re.fullmatch(
        rf"float8 is emulated here, and slower in [01] of 1 variants: {re.escape(NO_GPU)}", lines[7]
    )


@pytest.mark.parametrize(
    "probe, xla, expected",
    [
        (HardwareProbe(), True, ("emulated", NO_GPU)),
        (
            HardwareProbe(gpu_compute_capabilities=((9, 0), (8, 6))),
            True,
            (
                "emulated",
                f"GPU compute capability 8.6: no float8 tensor cores (needs 8.9); {EMULATION}",
            ),
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((9, 0),)),
            False,
            (
                "emulated",
                "GPU compute capability 9.0 has float8 tensor cores, but only XLA's GEMM rewrite "
                f"reaches them and XLA is off; {EMULATION}",
            ),
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((8, 9),)),
            True,
            ("native", "GPU compute capability 8.9 and XLA: float8 tensor cores"),
        ),
        (
            HardwareProbe(tpu=True),
            True,
            (
                "emulated",
                f"TPU: its float8 support is not probed, so counted as emulated; {EMULATION}",
            ),
        ),
    ],
    ids=["cpu", "one_gpu_without", "xla_off", "ada_with_xla", "tpu"],
)
def test_float8_is_native_only_with_xla_on_gpus_with_float8_tensor_cores(probe, xla, expected):
    assert float8_variants.execution(probe, xla) == expected


def _float8_row(step_ms: float, float8: dict | None, vs_no_float8: dict | None) -> dict:
    return {
        "compute_dtype": "bfloat16",
        "median_step_seconds": step_ms / 1e3,
        "examples_per_second": 64 / (step_ms / 1e3),
        "tokens_per_second": None,
        "flops_per_second": None,
        "fraction_of_matmul_peak": None,
        "peak_memory_bytes": 2**20,
        "speed": {
            "vs_float32": None,
            "vs_stock": None,
            "vs_no_xla": None,
            "vs_no_float8": vs_no_float8,
        },
        "op_profile": None,
        "float8": float8,
    }


def test_the_table_labels_float8_variants_and_says_how_their_float8_ran():
    native = "GPU compute capability 9.0 and XLA: float8 tensor cores"
    result = {
        "matmul_peak": {
            "size": 64,
            "rounds": 2,
            "flops_per_second": {"float32": 1e11, "bfloat16": 2e11, "float16": 5e10},
        },
        "variants": {
            "mlp/mixed_bfloat16/xla_on/ours": _float8_row(2.0, None, None),
            "mlp/mixed_bfloat16+float8/xla_on/ours": _float8_row(
                4.0,
                {"execution": "emulated", "reason": NO_GPU},
                {"ratio": 0.5, "paired_ratio_median": 0.52},
            ),
            "lm/mixed_bfloat16+float8/xla_on/ours": _float8_row(
                1.0,
                {"execution": "native", "reason": native},
                {"ratio": 1.25, "paired_ratio_median": 1.2},
            ),
        },
        "float8": {"layers": {"mlp": ["dense_0", "logits"], "lm": ["block_0/mlp_up"]}},
        "auto_jit_compile": {},
        "machine": {
            "cpu": "AMD EPYC",
            "cpu_count": 2,
            "cpu_flags": [],
            "tensorflow": "2.21.0",
            "keras": "3.15.1",
        },
    }
    lines = suite_report.table(result).splitlines()
    assert [line[:49].rstrip() for line in lines[1:4]] == [
        "mlp/mixed_bfloat16/xla_on/ours",
        "mlp/mixed_bfloat16+float8/xla_on/ours (emulated)",
        "lm/mixed_bfloat16+float8/xla_on/ours (native)",
    ]
    assert lines[5:9] == [
        "float8 variants (Dense and EinsumDense layers in float8: mlp 2, lm 1): examples/s over "
        "the same variant without float8",
        "mlp/mixed_bfloat16+float8/xla_on/ours (emulated)  0.50 (paired 0.52): slower",
        "lm/mixed_bfloat16+float8/xla_on/ours (native)     1.25 (paired 1.20): faster",
        f"float8 is emulated here, and slower in 1 of 1 variants: {NO_GPU}",
    ]
    assert lines[9] == f"float8 is native here, and slower in 0 of 1 variants: {native}"


USER_CODE = """
import keras
import numpy as np
import tensorflow as tf


def pixels_and_counts(num_classes):
    pixels = keras.Input((4, 4, 1), name="pixels")
    counts = keras.Input((3,), name="counts")
    features = keras.layers.Conv2D(2, 3, padding="same", activation="relu")(pixels)
    features = keras.layers.Concatenate()([keras.layers.Flatten()(features), counts])
    logits = keras.layers.Dense(num_classes, name="logits")(features)
    return keras.Model({"pixels": pixels, "counts": counts}, logits)


def pixels_and_counts_data(seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "pixels": rng.normal(size=(32, 4, 4, 1)).astype("float32"),
        "counts": rng.normal(size=(32, 3)).astype("float32"),
    }
    y = rng.integers(0, 3, size=32).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return dataset, dataset.take(8), {"num_classes": 3}
"""


@pytest.fixture
def user_config(tmp_path, monkeypatch):
    """A run config of the user's own model (two named inputs), data and loss, and its directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_user_code.py").write_text(USER_CODE)
    yield TrainConfig.from_dict(
        {
            "model": {"factory": "bench_user_code:pixels_and_counts"},
            "data": {"factory": "bench_user_code:pixels_and_counts_data", "batch_size": 4},
            "loss": {"name": "sparse_categorical_crossentropy", "options": {"from_logits": True}},
        }
    )
    sys.modules.pop("bench_user_code", None)


def test_a_configs_own_model_data_and_loss_are_measured_side_by_side(user_config):
    settings = suite_settings.Settings(
        config=user_config,
        config_name="pixels_and_counts",
        precisions=("float32", "mixed_bfloat16"),
        xla=("off",),
        stacks=("ours", "stock"),
        rounds=2,
        steps_per_round=1,
        warmup_steps=1,
        memory_steps=1,
        matmul_size=8,
        matmul_rounds=1,
    )
    result = suite.measure(settings)
    names = [
        f"pixels_and_counts/{precision}/xla_off/{stack}"
        for precision in ("float32", "mixed_bfloat16")
        for stack in ("ours", "stock")
    ]
    assert list(result["variants"]) == names
    # Per example: the convolution, 2 * (4*4*2) * (3*3*1), and the logits, 2 * (32+3) * 3.
    forward_per_example = 2 * 32 * 9 + 2 * 35 * 3
    for name, row in result["variants"].items():
        assert len(row["step_seconds"]) == 2, name
        assert all(math.isfinite(seconds) and seconds > 0 for seconds in row["step_seconds"])
        assert row["examples_per_second"] == 4 / row["median_step_seconds"]
        assert row["tokens_per_second"] is None
        assert row["train_step_flops"] == 3 * 4 * forward_per_example
        assert row["variable_bytes"] > 0
    for stack in ("ours", "stock"):
        speed = result["variants"][f"pixels_and_counts/mixed_bfloat16/xla_off/{stack}"]["speed"]
        assert {key: type(value) for key, value in speed["vs_float32"].items()} == RATIO
        assert all(math.isfinite(value) for value in speed["vs_float32"].values())
    assert result["models"] == {
        "pixels_and_counts": {
            "name": "pixels_and_counts",
            "model": {"factory": "bench_user_code:pixels_and_counts"},
            "loss": "SparseCategoricalCrossentropy",
            "batch_size": 4,
            "inputs": {
                "counts": {"shape": [4, 3], "dtype": "float32"},
                "pixels": {"shape": [4, 4, 4, 1], "dtype": "float32"},
            },
            "dimensions": {"num_classes": 3},
            "parameters": (3 * 3 * 1 * 2 + 2) + (35 * 3 + 3),
        }
    }
    assert list(result["auto_jit_compile"]) == [
        "pixels_and_counts/float32",
        "pixels_and_counts/mixed_bfloat16",
    ]
    assert json.loads(json.dumps(result))["settings"]["config"]["model"]["factory"] == (
        "bench_user_code:pixels_and_counts"
    )
    rows = suite_report.table(result).splitlines()[1 : 1 + len(names)]
    assert [row.split()[0] for row in rows] == names


def test_every_variant_of_a_configs_model_starts_from_the_same_weights(user_config):
    workload = workloads.from_config(user_config, "pixels_and_counts")
    float32 = workload.build()
    with global_policy("mixed_bfloat16"):
        bfloat16 = workload.build()
    assert bfloat16.get_layer("logits").compute_dtype == "bfloat16"
    for built in (float32, bfloat16):
        assert [weights.tolist() for weights in built.get_weights()] == [
            weights.tolist() for weights in float32.get_weights()
        ]


def test_a_model_files_layers_compute_in_each_variants_policy(user_config, tmp_path):
    saved = workloads.from_config(user_config, "pixels_and_counts").build()
    saved.compile(loss="sparse_categorical_crossentropy")
    saved.save(tmp_path / "pixels.keras")
    config = user_config.merged({"model": {"file": "pixels.keras"}})
    with global_policy("mixed_bfloat16"):
        loaded = workloads.from_config(config, "pixels").build()
    # Saved in float32, its layers would keep float32 whatever the global policy.
    computing = [layer.compute_dtype for layer in loaded.layers if layer.weights]
    assert computing == ["bfloat16", "bfloat16"]  # The convolution and the logits.
    assert [w.tolist() for w in loaded.get_weights()] == [w.tolist() for w in saved.get_weights()]


def test_config_and_models_together_are_one_line_naming_both_flags():
    config = os.path.join(REPO, "examples", "configs", "small_cnn_digits.json")
    result = launch_in_process("mpt-bench", f"--config={config}", "--models=cnn")
    assert result.status == 2
    assert result.stderr.splitlines()[-1] == (
        "mpt-bench: error: --config and --models: received both. Allowed: one of them; with "
        "--config the config decides (its model.name, model.factory or model.file: edit it or "
        "use --config_override)"
    )
    assert result.stdout == ""


def test_a_bad_flag_is_one_line_on_stderr_and_status_2():
    # absl's own flag checks, such as --rounds=0, go the same way through trainers.cli.
    result = launch_in_process("mpt-bench", "--models=cnn,resnet")
    assert result.status == 2
    assert result.stderr.splitlines()[-1] == (
        "mpt-bench: error: models: received 'resnet'. "
        "Allowed: one or more of transformer_lm, cnn, mlp, each once"
    )
    assert result.stdout == ""


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"precisions": ()}, "precisions: received []. Allowed: one or more of"),
        ({"xla": ("on", "on")}, "xla: received ['on', 'on']. Allowed: one or more of off, on"),
        ({"stacks": ("theirs",)}, "stacks: received 'theirs'. Allowed: one or more of ours, stock"),
        ({"rounds": 0}, "rounds: received 0. Allowed: an integer >= 1"),
        ({"profile_steps": -1}, "profile_steps: received -1. Allowed: an integer >= 0"),
        ({"d_model": 10}, "d_model: received 10. Allowed: a multiple of 4 (the attention heads)"),
        (
            {"float8": True, "precisions": ("float32",)},
            "float8: received with precisions ['float32']. Allowed: with mixed_float16 or "
            "mixed_bfloat16 among the precisions",
        ),
        (
            {"models": ("cnn",), "config": TrainConfig()},
            "models and config: received both. Allowed: reference models or a run config, not both",
        ),
        (
            {"config": TrainConfig(), "config_name": "digits/cnn"},
            "config_name: received 'digits/cnn'. Allowed: a name without '/'",
        ),
        ({"config": {"model": "cnn"}}, "config: received dict. Allowed: a TrainConfig"),
    ],
)
def test_settings_name_the_bad_field_and_what_is_allowed(changes, message):
    with pytest.raises(UserInputError) as raised:
        suite_settings.Settings(**changes)
    assert str(raised.value).startswith(message)


def test_einsum_flops_count_every_distinct_index():
    @tf.function
    def attention_scores(query, key):
        return tf.einsum("btnh,bsnh->bnts", query, key)

    graph = attention_scores.get_concrete_function(
        tf.TensorSpec((2, 5, 3, 4)), tf.TensorSpec((2, 6, 3, 4))
    ).graph
    assert flops.product_flops(graph.get_operations()) == 2 * 2 * 5 * 3 * 4 * 6


def test_the_plot_has_a_row_per_variant():
    bars = [
        ("cnn f32 xla_off ours", "float32", 1.5),
        ("cnn bf16 xla_off ours", "mixed_bfloat16", 3.0),
    ]
    one = tf.io.decode_png(chart.plot_throughput(bars[:1], {"float32": 10.0}))
    two = tf.io.decode_png(chart.plot_throughput(bars, {"float32": 10.0}))
    assert two.shape[0] - one.shape[0] == 18  # One row of 9 font pixels, scaled 2x.
    assert np.any(np.all(two.numpy() == (255, 127, 14), axis=-1))  # The bfloat16 bar.


def _xspace(events):
    """An XSpace with one plane: `events` maps line name to [(event name, picoseconds)]."""
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    ids = {}
    for line_name, line_events in events.items():
        line = plane.lines.add(name=line_name)
        for name, picoseconds in line_events:
            if name not in ids:
                ids[name] = len(ids) + 1
                plane.event_metadata[ids[name]].name = name
            line.events.add(metadata_id=ids[name], duration_ps=picoseconds)
    return space


def test_op_seconds_sum_the_executor_ops_per_type_and_step(tmp_path):
    space = _xspace(
        {
            "tf_Compute/1": [
                ("dense/MatMul:_MklMatMul", 3_000_000),
                ("ExecutorState::Process", 50_000_000),  # Bookkeeping, not an op.
                ("dense/Cast:Cast", 1_000_000),
            ],
            "tf_Compute/2": [("grad/MatMul_1:_MklMatMul", 1_000_000), ("add:AddV2", 2_000_000)],
            "python": [("other/MatMul:_MklMatMul", 9_000_000)],  # Not the executor's.
        }
    )
    path = tmp_path / "trace.xplane.pb"
    path.write_bytes(space.SerializeToString())
    seconds = op_profile.op_seconds(str(path), steps=2)
    assert seconds == pytest.approx({"_MklMatMul": 2e-6, "AddV2": 1e-6, "Cast": 0.5e-6})
    assert list(seconds) == ["_MklMatMul", "AddV2", "Cast"]  # Most first.
    assert op_profile.breakdown(seconds) == pytest.approx(
        {"matmul": 2e-6, "cast": 0.5e-6, "other": 1e-6, "total": 3.5e-6}
    )


@pytest.mark.parametrize(
    "op_type, expected",
    [
        ("_MklMatMul", "matmul"),
        ("_MklBatchMatMulV2", "matmul"),
        ("_MklEinsum", "matmul"),
        ("_MklNativeFusedConv2D", "matmul"),
        ("_MklNativeConv2DBackpropFilterWithBias", "matmul"),
        ("_FusedMatMul", "matmul"),
        ("Conv2DBackpropInput", "matmul"),
        ("_MklNativeMaxPool", "other"),
        ("MatrixDiag", "other"),
        ("Cast", "cast"),
        ("Mul", "other"),
    ],
)
def test_op_categories(op_type, expected):
    assert op_profile.category(op_type) == expected


def test_profiled_low_precision_is_compared_with_float32_and_peak_matmuls():
    float32 = suite_settings.Variant("cnn", "float32", "off", "ours")
    bfloat16 = suite_settings.Variant("cnn", "mixed_bfloat16", "off", "ours")
    measured = measuring.Measurements(
        step_seconds={},
        memory={},
        train_step_flops={},
        op_seconds={
            float32.name: {"_MklMatMul": 0.6, "Mul": 0.4},
            bfloat16.name: {"_MklMatMul": 0.4, "Cast": 0.1, "Mul": 0.3},
        },
        traces={float32.name: None, bfloat16.name: None},
    )
    peak = {"flops_per_second": {"float32": 1e11, "bfloat16": 2e11, "float16": 1e11}}
    profile = variant_records.variant_op_profile(bfloat16, measured, peak)
    assert profile["fractions"] == pytest.approx({"matmul": 0.5, "cast": 0.125, "other": 0.375})
    assert profile["matmul_speedup_vs_float32"] == pytest.approx(1.5)
    assert profile["op_time_speedup_vs_float32"] == pytest.approx(1.0 / 0.8)
    # Float32's 0.6 s of matmuls at twice the peak, this variant's 0.1 s of
    # casts and 0.3 s of other ops: 1.0 / (0.3 + 0.1 + 0.3).
    assert profile["speedup_with_peak_matmuls"] == pytest.approx(1 / 0.7)
    assert (
        variant_records.variant_op_profile(float32, measured, peak)["speedup_with_peak_matmuls"]
        is None
    )
    assert (
        variant_records.variant_op_profile(
            suite_settings.Variant("cnn", "float32", "on", "ours"), measured, peak
        )
        is None
    )


def test_an_output_dir_that_cannot_be_made_is_refused_before_measuring(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    measured = []
    monkeypatch.setattr(suite, "measure", lambda *args: measured.append(args))
    with pytest.raises(UserInputError) as raised:
        suite.run(suite_settings.Settings(), output_dir=str(blocker / "out"))
    assert str(raised.value) == (
        f"output: received {blocker / 'out'} (cannot be created: Not a directory). "
        "Allowed: a directory that can be created and written"
    )
    assert measured == []

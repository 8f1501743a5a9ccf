"""compiled_gemms: GEMMs read from optimized HLO text, with the precision each runs in.

`data/gpu_float8_step.hlo` is written in the form XLA prints an optimized GPU program (as its
gemm_rewriter tests show it): a float8 cuBLASLt call whose operands are float8 parameters, a
bfloat16 cuBLASLt call, a bfloat16 dot inside a GEMM fusion, a dot of another layer, and a
custom call that is not a GEMM. A census of it on a float8 device: 1 of 3 GEMMs in float8.
"""

import os

from mpt_keras.precision.compiled_gemms import CompiledGemm, compiled_gemms
from mpt_keras.precision.float8_census import census_of

SCOPE = "jit(train_step)/{}(model)/mlp/mpt_float8_census_0/dot_general"
with open(os.path.join(os.path.dirname(__file__), "data", "gpu_float8_step.hlo")) as file:
    HLO = file.read()


def test_every_gemm_is_read_with_its_operands_types_and_scope():
    gemms = compiled_gemms(HLO)
    assert [(g.name, g.kernel, g.operand_types, g.result_shape) for g in gemms] == [
        ("dot.7", "dot", ("bf16", "bf16"), (64, 256)),
        (
            "custom-call.1",
            "__cublas$lt$matmul$f8",
            ("f8e4m3fn", "f8e4m3fn", "f32", "f32"),
            (2048, 256),
        ),
        ("custom-call.2", "__cublas$lt$matmul", ("bf16", "bf16"), (2048, 64)),
        ("dot.9", "dot", ("f32", "f32"), (8, 8)),
    ]
    assert [g.precision for g in gemms] == ["bfloat16", "float8", "bfloat16", "float32"]
    assert gemms[1].op_name == SCOPE.format("jvp")


def test_a_census_of_it_on_a_float8_device_finds_one_float8_gemm_of_three():
    census = census_of(compiled_gemms(HLO), {"model/mlp": 64 * 256}, True, "GPU 9.0")
    assert [(r.gemm, r.runs_in, r.kernel, r.verdict) for r in census.rows] == [
        ("forward", "float8", "__cublas$lt$matmul$f8", "float8"),
        ("input gradient", "bfloat16", "__cublas$lt$matmul", "fallback"),
        ("weight gradient", "bfloat16", "dot", "fallback"),
    ]
    assert (
        census.summary() == "partly float8: 1 of 3 GEMMs of 1 float8 layer run in float8 (GPU 9.0)"
    )
    assert census.to_dict()["gemms"][0] == {
        "layer": "model/mlp",
        "gemm": "forward",
        "runs_in": "float8",
        "kernel": "__cublas$lt$matmul$f8",
        "verdict": "float8",
    }


def test_a_float8_layer_with_no_gemm_found_is_unseen():
    census = census_of(compiled_gemms(HLO), {"model/mlp": 1, "model/other": 1}, True, "GPU")
    assert census.unseen == ("model/other",)
    assert census.summary() == (
        "partly float8: 1 of 3 GEMMs of 2 float8 layers run in float8; no GEMM found for 1 of "
        "the layers (GPU)"
    )
    assert census.format_table().splitlines()[-1].split() == ["model/other", "(none", "found)"]


def test_precision_is_the_widest_operand_unless_both_are_float8():
    def gemm(*types, kernel="dot"):
        return CompiledGemm("g", kernel, types, (2, 2), "")

    assert gemm("f8e5m2", "f8e4m3fn").precision == "float8"
    assert gemm("f8e4m3fn", "bf16").precision == "bfloat16"
    assert gemm("bf16", "f32").precision == "float32"
    assert gemm("f16", "f16").precision == "float16"
    assert gemm("f32", "f32", kernel="__cublas$lt$matmul$f8").precision == "float8"


def test_a_dot_in_a_triton_gemm_fusion_is_a_triton_gemm_of_its_parameters_types():
    """`data/h100_float8_triton.hlo`: two GEMM fusions of XLA's program for an H100 (jaxlib
    0.10.2, compiled on a CPU by tests/jax_backend/test_float8_census_for_a_gpu.py's means),
    cut down: a split-K weight gradient e4m3 x e5m2 and a forward e4m3 x e4m3, the scales
    multiplied in the fusion."""
    with open(os.path.join(os.path.dirname(__file__), "data", "h100_float8_triton.hlo")) as file:
        gemms = compiled_gemms(file.read())
    assert [(g.name, g.kernel, g.operand_types, g.result_shape, g.precision) for g in gemms] == [
        ("dot.3", "triton gemm", ("f8e4m3fn", "f8e5m2"), (8, 64, 128), "float8"),
        ("dot_general.1", "triton gemm", ("f8e4m3fn", "f8e4m3fn"), (256, 128), "float8"),
    ]
    assert gemms[0].op_name == "jit(loss)/transpose(jvp(up))/float8_weight_gradient/dot_general"

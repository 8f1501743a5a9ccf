"""Fixtures shared by the test files, and the choice of files per Keras backend."""

import os
from typing import Any

# As the launchers do (trainers/__init__.py): CPU memory statistics on every
# CPU, so the monitor's and the benchmarks' memory figures are tested here too.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# XLA's CPU backend compiling for speed of compiling, here and in every process the tests start
# (they inherit XLA_FLAGS): the tests' models are tiny, so compiling is most of an XLA step's
# cost. LLVM at its lowest optimization level: a 1-block Transformer's train step compiles in
# 2.7 s instead of 7.4 s on 2 cores. On JAX also XLA's elemental emitters instead of its MLIR
# fusion emitters, and one LLVM module per program: a small MLP's gradient compiles in 128 ms
# instead of 263 ms, and the JAX child suite took 242 s of CPU instead of 390 s (2 AVX2 EPYC
# cores, 2026-12-07; the 390 s also held a test since made cheaper). Not on TensorFlow: its
# XLA (TF 2.21) then rounds float32 to float8 off round-to-nearest-even (809 of 200,000 values
# to e4m3, 369 to e5m2), where jaxlib 0.10.2's rounds every one as ml_dtypes does.
# The float8 census finds the same GEMMs, kernels and types under them; the last bits of some
# results change (a jitted tanh, a bfloat16 sum), and the tests' pinned numbers hold. The
# benchmarks' figures are never taken under them (the tests only dry-run them).
# One TensorFlow intra-op thread per process (children inherit it): three workers share two
# cores, and TensorFlow's spinning pools cost CPU. tests/test_execution_xla.py took 110.6 s of
# CPU with it and 123.7 s without (one run each, 2 AVX2 EPYC cores, 2026-11-28).
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
# JAX on the CPU, here and in every child: the tests pin CPU figures, and the test extra's
# CUDA plugin (for compiling for a GPU without one) would otherwise look for a GPU at JAX's
# start, and print that it found no cuDNN.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
XLA_TEST_FLAGS = ("--xla_backend_optimization_level=0",)
if os.environ.get("KERAS_BACKEND") == "jax":
    XLA_TEST_FLAGS += (
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    )
for _flag in XLA_TEST_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


import keras  # noqa: E402
import pytest  # noqa: E402

from mpt_keras.precision.hardware import CPUINFO_ENV  # noqa: E402

# Every test, and every process it starts, decides `auto` (the precision, `jit_compile`) as on
# one CPU, whatever the machine's: one with AVX512_BF16. On a CPU without it, `auto` turned XLA
# on for bfloat16 convolutions, so the suite took other paths there and compiled XLA in every
# run of the default CNN (a 2-step run: 8 s of CPU instead of 2 s on AVX2). Each CPU's
# decisions are pinned by probes of their own (tests/test_execution_jit_rule.py,
# tests/test_precision_hardware.py); what reads the machine itself names /proc/cpuinfo.
CPUINFO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpuinfo_avx512_bf16")
os.environ.setdefault(CPUINFO_ENV, CPUINFO)

# Per backend, the test folders that run there (a file's folder outside these runs on TensorFlow).
_ON_JAX = ("any_backend", "jax_backend")


def pytest_ignore_collect(collection_path, config):
    """On JAX, only the neutral and JAX folders; on TensorFlow, all but the JAX folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    relative = os.path.relpath(str(collection_path), here)
    if relative == "." or relative.startswith(".."):
        return None
    folder = relative.split(os.sep)[0]
    if keras.backend.backend() == "jax":
        return None if folder in _ON_JAX or relative.endswith("conftest.py") else True
    return True if folder == "jax_backend" else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Keeps each module's costly shared work on one worker, and starts the slowest first.

    Under `pytest -n 3` (`--dist loadgroup`, setup.cfg) a test file's
    module-scoped fixtures (a child process that trains on two replicas, the
    launcher's 14 flag rows) would run once on each worker that receives one
    of its tests: the tests that use one are grouped (`xdist_group`), so they
    run on one worker, and it runs once. xdist starts the largest groups first;
    the tests marked `slow` come next, so that no long test is left to the end
    while the other worker idles. Without xdist the groups mean nothing and
    the slow tests simply run first.
    """
    for item in items:
        # A test file marked with a group keeps it (the two-CPU host's, tests/replicas.py).
        if _uses_a_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    # pytest (8.x) has no public view of a collected test's fixture scopes;
    # `_fixtureinfo` is the one its own plugins read.
    return any(
        definition.scope == "module"
        for definitions in item._fixtureinfo.name2fixturedefs.values()
        for definition in definitions
    )


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by a test session; embedded datasets prepare on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture
def no_memory_statistics(monkeypatch):
    """Makes every device answer as one whose allocator keeps no statistics.

    As TensorFlow's default CPU allocator does on a CPU without oneDNN.
    """

    import tensorflow as tf

    def untracked(device):
        raise ValueError(f"Allocator stats not available for device '{device}'")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", untracked)


@pytest.fixture
def tiny_gpt2():
    """Builds tiny keras_hub GPT-2 backbones from arguments (no preset, no network)."""
    import keras_hub

    def build(num_layers: int = 2, **options: Any) -> keras.Model:
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=num_layers,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
            **options,
        )

    return build


@pytest.fixture
def tiny_llama():
    """Builds tiny keras_hub Llama backbones (one block) from arguments (no preset, no network)."""
    import keras_hub

    def build(**options: Any) -> keras.Model:
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=64,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=16,
            intermediate_dim=32,
            **options,
        )

    return build


@pytest.fixture(autouse=True)
def _restore_keras_state():
    """Each test starts from Keras' defaults: float32 policy, fresh name scopes."""
    yield
    keras.config.set_dtype_policy("float32")
    # Without Python's full garbage collection (`free_memory`), which costs
    # 0.2-0.4 s once TensorFlow is loaded: a third of a minute per 100 tests.
    keras.backend.clear_session(free_memory=False)

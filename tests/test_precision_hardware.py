"""Tests of mpt_keras.precision.hardware: precision `auto` on each kind of machine."""

import os

import pytest
from conftest import CPUINFO

from mpt_keras.errors import UserInputError
from mpt_keras.precision.hardware import (
    CPUINFO_ENV,
    PROC_CPUINFO,
    HardwareProbe,
    probe_hardware,
    resolve_auto_policy,
)


@pytest.mark.parametrize(
    "probe, policy, reason",
    [
        (
            HardwareProbe(tpu=True, gpu_compute_capabilities=((7, 0),)),
            "mixed_bfloat16",
            "TPU: bfloat16 is the native type of its matrix units",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((9, 0),)),
            "mixed_bfloat16",
            "GPU compute capability 9.0: bfloat16 tensor cores",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((8, 0), (8, 6))),
            "mixed_bfloat16",
            "GPU compute capability 8.0: bfloat16 tensor cores",
        ),
        (
            HardwareProbe(
                gpu_compute_capabilities=((8, 6), (7, 5)), cpu_flags=frozenset({"avx512_bf16"})
            ),
            "mixed_float16",
            "GPU compute capability 7.5: float16 tensor cores, no bfloat16 ones (needs 8.0)",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((7, 0),)),
            "mixed_float16",
            "GPU compute capability 7.0: float16 tensor cores, no bfloat16 ones (needs 8.0)",
        ),
        (
            HardwareProbe(gpu_compute_capabilities=((6, 1),)),
            "float32",
            "GPU compute capability 6.1: no tensor cores (needs 7.0)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"avx2", "avx512_bf16"})),
            "mixed_bfloat16",
            "no GPU or TPU; CPU computes bfloat16 (avx512_bf16)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})),
            "mixed_bfloat16",
            "no GPU or TPU; CPU computes bfloat16 (avx512_bf16, amx_bf16)",
        ),
        (
            HardwareProbe(cpu_flags=frozenset({"avx2", "amx_tile"})),
            "float32",
            "no GPU or TPU, and the CPU lacks bfloat16 instructions (avx512_bf16 or amx_bf16)",
        ),
        (
            HardwareProbe(),
            "float32",
            "no GPU or TPU, and the CPU lacks bfloat16 instructions (avx512_bf16 or amx_bf16)",
        ),
    ],
    ids=[
        "tpu",
        "gpu_9.0",
        "gpus_8.x",
        "lowest_gpu_decides",
        "gpu_7.0",
        "gpu_6.1",
        "cpu_avx512",
        "cpu_amx",
        "cpu_amx_tile_only",
        "nothing",
    ],
)
def test_resolve_auto_policy(probe, policy, reason):
    assert resolve_auto_policy(probe) == (policy, reason)


def test_probe_reads_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    assert probe_hardware(str(cpuinfo)).cpu_flags == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert probe_hardware(str(tmp_path / "missing")).cpu_flags == frozenset()


def _machine_has(flag):
    try:
        with open(PROC_CPUINFO) as file:
            return flag in file.read().split()
    except OSError:
        return False


@pytest.mark.skipif(not _machine_has("avx512_bf16"), reason="this CPU lacks avx512_bf16")
def test_probe_finds_this_machines_bfloat16_cpu():
    probe = probe_hardware(PROC_CPUINFO)
    assert "avx512_bf16" in probe.cpu_flags
    assert resolve_auto_policy(probe)[0] == "mixed_bfloat16"


def test_the_suite_decides_as_on_one_cpu_whatever_the_machines(monkeypatch, tmp_path):
    # conftest names the suite's CPU for this process and the ones it starts.
    assert os.environ[CPUINFO_ENV] == CPUINFO
    assert "avx512_bf16" in probe_hardware().cpu_flags
    assert resolve_auto_policy() == (
        "mixed_bfloat16",
        "no GPU or TPU; CPU computes bfloat16 (avx512_bf16)",
    )
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    monkeypatch.setenv(CPUINFO_ENV, str(cpuinfo))
    assert probe_hardware().cpu_flags == frozenset({"fpu", "avx2"})
    assert resolve_auto_policy()[0] == "float32"
    monkeypatch.setenv(CPUINFO_ENV, "")  # Set but empty: this machine's.
    assert probe_hardware() == probe_hardware(PROC_CPUINFO)


def test_a_cpuinfo_that_is_not_there_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(CPUINFO_ENV, str(tmp_path / "cpuinfo"))
    with pytest.raises(UserInputError) as raised:
        probe_hardware()
    assert str(raised.value) == (
        f"MPT_KERAS_CPUINFO: received '{tmp_path / 'cpuinfo'}'. "
        "Allowed: a file in /proc/cpuinfo's format, or unset"
    )

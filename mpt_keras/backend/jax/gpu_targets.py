"""Compiling for a GPU this machine lacks: XLA's own GPU compiler, run without the device.

JAX's CUDA plugin compiles for a GPU it is told about (XLA's `GpuTargetConfigProto`: compute
capability, cores, memory, CUDA's version) through a compile-only topology, on any machine,
GPU or none. The program it returns is the one XLA would run there, with one difference: no
autotuning, which times kernels on the device (where a Triton GEMM and a cuBLAS one could
both serve, the device might pick the other). It needs
the plugin of this jaxlib's version (`jax-cuda13-plugin`) and CUDA's `ptxas` (a CUDA
toolkit's, or pip's `nvidia-cuda-nvcc`); it needs no GPU driver, cuDNN nor cuBLAS.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jaxlib

from mpt_keras.backend.names import GPU_TARGETS
from mpt_keras.checks import refusal
from mpt_keras.errors import UserInputError, first_line

# Each target's device as XLA describes it: its name, memory (bytes) and bandwidth (bytes/s).
_DEVICES = {
    "h100": ("NVIDIA H100 80GB HBM3", 84929347584, 3352320000000),
    "h200": ("NVIDIA H200", 150110011392, 4800000000000),
}
# Both are Hopper: the same SMs (float8 tensor cores among them), other memory.
COMPUTE_CAPABILITY = (9, 0)
_HOPPER = """gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  core_count: 132
  fpus_per_core: 128
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  clock_rate_ghz: 1.98
  l2_cache_size: 52428800
  device_memory_size: {memory}
  memory_bandwidth: {bandwidth}
}}
platform_name: "CUDA"
runtime_version {{ major: 13 minor: 0 }}
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{name}"
"""


def target_config(target: str) -> str:
    """XLA's description of `target` (one of `GPU_TARGETS`), as the CUDA plugin parses it."""
    check_target(target)
    name, memory, bandwidth = _DEVICES[target]
    major, minor = COMPUTE_CAPABILITY
    return _HOPPER.format(major=major, minor=minor, name=name, memory=memory, bandwidth=bandwidth)


def check_target(target: str) -> None:
    if target not in GPU_TARGETS:
        raise refusal("GPU target", repr(target), ", ".join(GPU_TARGETS))


@functools.cache
def compile_only_device(target: str) -> Any:
    """A device of `target` that compiles and never runs. A one-line `UserInputError` where
    JAX's CUDA plugin is missing."""
    from jax.experimental import topologies

    config = target_config(target)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=config
        )
    except Exception as error:  # The plugin's absence reads differently per JAX version.
        raise UserInputError(
            f"compiling for GPU target '{target}': no CUDA compile-only topology "
            f"({first_line(error) or type(error).__name__}). It needs "
            f"JAX's CUDA plugin of this jaxlib's version: pip install "
            f"jax-cuda13-plugin=={jaxlib.__version__}"
        ) from None
    return topology.devices[0]


def optimized_hlo(function: Any, args: tuple[Any, ...], target: str) -> str:
    """The optimized HLO text of `jax.jit(function)` on arrays shaped as `args`, compiled for
    `target` (never run; `args`' values are not read)."""
    sharding = jax.sharding.SingleDeviceSharding(compile_only_device(target))
    abstract = jax.tree.map(
        lambda value: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding), args
    )
    try:
        return jax.jit(function).lower(*abstract).compile().as_text()
    except jax.errors.JaxRuntimeError as error:
        message = str(error)
        if "ptxas" not in message:
            raise
        raise UserInputError(
            f"compiling for GPU target '{target}' needs CUDA's ptxas: none found (install a "
            "CUDA toolkit, or pip install nvidia-cuda-nvcc)"
        ) from None

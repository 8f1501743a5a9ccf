"""absl launchers: each parses its flags and calls one `mpt_keras` function.

Importing this package (which every launcher does first, being in it) silences
TensorFlow's native start-up lines, so that a user error is the only line a
failing launcher prints. `MPT_SHOW_TF_STARTUP=1` shows them. It also makes
TensorFlow allocate CPU memory with its BFC allocator, the one CPU allocator
that keeps statistics of every allocation (`tf.config.experimental.get_memory_info`),
which the monitor's `peak_memory_mib` and `mpt-bench`'s memory figures read;
`TF_CPU_ALLOCATOR_USE_BFC=false` turns that off.
"""

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Sends file descriptor 2 to /dev/null for the duration of a block.

    TensorFlow's C++ start-up lines (oneDNN, CUDA probing) are written before
    its log level applies, straight to the descriptor.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Later C++ info lines are filtered by the level; TF_CPP_MIN_LOG_LEVEL=0 shows them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Read when TensorFlow first allocates on the CPU. Without it, CPU memory
# statistics exist only with oneDNN's allocator (CPUs with AVX512 and newer),
# which counts allocations of 256 KiB and more.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
if os.environ.get("MPT_SHOW_TF_STARTUP") != "1":
    with _native_stderr_silenced():
        import tensorflow as tf

        # Probing the physical devices is where the CUDA start-up lines come from;
        # it does not initialise the runtime, so logical devices stay configurable.
        tf.config.list_physical_devices()

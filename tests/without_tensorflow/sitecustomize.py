"""A Python whose path starts here runs as on a machine without TensorFlow (the lent GPUs).

Python imports `sitecustomize` at its start, so a process given this folder first on its
`PYTHONPATH` (tests/launchers.py: `without_tensorflow`) and every process it starts find no
TensorFlow: the JAX child pytest (tests/test_jax_backend.py), the JAX processes of the GPU
dry runs and of the JAX kill-and-resume test. Without it, TensorFlow installed beside JAX
would load there (Keras' JAX backend imports it where it can, as `keras.utils.set_random_seed`
does), where a GPU machine has none.
"""

import importlib.abc
import sys
from typing import Any


class _NoTensorFlow(importlib.abc.MetaPathFinder):
    """Wraps a finder of `sys.meta_path` so that it finds no TensorFlow: `import tensorflow`
    raises ModuleNotFoundError and `importlib.util.find_spec("tensorflow")` is None.
    Libraries probe with the latter (etils' paths, under JAX's compilation cache), so a
    finder that raised would differ from a machine without TensorFlow."""

    BLOCKED = ("tensorflow", "tensorflow_datasets", "tf_keras")

    def __init__(self, finder: Any):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.BLOCKED or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, name: str) -> Any:  # find_distributions, invalidate_caches, ...
        return getattr(self._finder, name)


sys.meta_path[:] = [_NoTensorFlow(finder) for finder in sys.meta_path]

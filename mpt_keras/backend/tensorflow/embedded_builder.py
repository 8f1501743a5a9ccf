"""What the embedded TFDS builders share: release 1.0.0, examples in key order, description
kept (not `dataset_info_from_configs()`: a README.md beside the module would replace it).
"""

import abc
from typing import Any

import tensorflow_datasets as tfds


class EmbeddedBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """An embedded dataset's builder; a subclass gives its `info_arguments`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    @abc.abstractmethod
    def info_arguments(self) -> dict[str, Any]:
        """`DatasetInfo` arguments (`description`, `features`, ...)."""

    def _info(self) -> tfds.core.DatasetInfo:
        # Key order, not TFDS' hash order.
        return tfds.core.DatasetInfo(builder=self, disable_shuffling=True, **self.info_arguments())

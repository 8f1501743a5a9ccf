"""`mpt_digits`: scikit-learn's bundled 8x8 handwritten digits as a TFDS dataset, read from
its CSV (no network)."""

from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from mpt_keras import embedded_arrays
from mpt_keras.backend.tensorflow.embedded_builder import EmbeddedBuilder

_DESCRIPTION = """\
The 1,797 8x8 grayscale handwritten digits of the UCI "Optical Recognition of
Handwritten Digits" test set, as bundled with scikit-learn
(`sklearn.datasets.load_digits`). Pixel counts 0..16 are rescaled to uint8 with
`round(v * 255 / 16)` (0 -> 0, 16 -> 255). Example i (in scikit-learn order) is
in `validation` iff i % 5 == 0 (360 examples), else in `train` (1,437 examples);
both splits keep scikit-learn order. The content's one home: `embedded_arrays.py`.
"""

_CITATION = """\
@misc{alpaydin1998optical,
  author = {Alpaydin, E. and Kaynak, C.},
  title = {Optical Recognition of Handwritten Digits},
  year = {1998},
  howpublished = {UCI Machine Learning Repository},
  doi = {10.24432/C50P49}
}
"""

_HOMEPAGE = "https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits"


class MptDigits(EmbeddedBuilder):
    """The digits, split deterministically into train/validation; keyed by index."""

    def info_arguments(self) -> dict[str, Any]:
        image = tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8)
        return {
            "description": _DESCRIPTION,
            "features": tfds.features.FeaturesDict(
                {"image": image, "label": tfds.features.ClassLabel(num_classes=10)}
            ),
            "supervised_keys": ("image", "label"),
            "homepage": _HOMEPAGE,
            "citation": _CITATION,
        }

    def _split_generators(
        self, dl_manager: tfds.download.DownloadManager
    ) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
        del dl_manager  # The data ships with scikit-learn.
        return {split: self._generate_examples(split) for split in embedded_arrays.SPLITS}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
        images, labels = embedded_arrays.digits(split)
        # Keyed by the example's index in scikit-learn's order.
        indices = embedded_arrays.digit_indices(split)
        for i, image, label in zip(indices, images, labels, strict=True):
            yield int(i), {"image": image, "label": int(label)}

"""`mpt_python_source`: the running Python's standard library as a text dataset.

Byte-level language modelling without a download: an example per top-level `*.py` file
(~170, under 5 MB for 3.11); the content depends on the Python version (in the
description). The content's one home: `embedded_arrays.py`.
"""

from collections.abc import Iterator
from typing import Any

import tensorflow_datasets as tfds

from mpt_keras import embedded_arrays
from mpt_keras.backend.tensorflow.embedded_builder import EmbeddedBuilder

_PYTHON_VERSION = embedded_arrays.PYTHON_VERSION

_DESCRIPTION = f"""\
The top-level `*.py` files of the standard library of the Python that prepared
the dataset (Python {_PYTHON_VERSION}), one example per file, in file-name order:
`path` is the file name relative to the standard library directory and `text`
its content decoded as UTF-8, with any invalid byte replaced by U+FFFD. A file
is in `validation` iff the first 8 bytes of the SHA-256 of its file name, read
as a big-endian integer, are 0 modulo 10; else it is in `train`. The content
depends on the Python version (and on the Python build), so data prepared by
two different Pythons may differ.
"""

_HOMEPAGE = "https://docs.python.org/3/library/"


class MptPythonSource(EmbeddedBuilder):
    """The stdlib's top-level source files, split by file name; keyed by position."""

    def info_arguments(self) -> dict[str, Any]:
        text = tfds.features.Text
        return {
            "description": _DESCRIPTION,
            "features": tfds.features.FeaturesDict({"path": text(), "text": text()}),
            "homepage": _HOMEPAGE,
        }

    def _split_generators(
        self, dl_manager: tfds.download.DownloadManager
    ) -> dict[str, Iterator[tuple[int, dict[str, str]]]]:
        del dl_manager  # The data is the local standard library.
        return {split: self._generate_examples(split) for split in embedded_arrays.SPLITS}

    def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, str]]]:
        for key, path, text in embedded_arrays.python_source(split):
            yield key, {"path": path, "text": text}

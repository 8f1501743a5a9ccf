"""`mpt_python_source`: the running Python's standard library as a text dataset.

Byte-level language modelling without a download: an example per top-level `*.py` file
(~170, under 5 MB for 3.11); the content depends on the Python version (in the description).
"""

import hashlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import tensorflow_datasets as tfds

from mpt_keras.data.embedded_builder import EmbeddedBuilder

_PYTHON_VERSION = "{}.{}".format(*sys.version_info[:2])

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

_VALIDATION_BUCKETS = 10


def stdlib_dir() -> str:
    """The running Python's standard library directory."""
    return os.path.dirname(os.__file__)


def stdlib_files() -> list[str]:
    """The standard library's top-level `*.py` file names, sorted."""
    root = stdlib_dir()
    return sorted(
        name
        for name in os.listdir(root)
        if name.endswith(".py") and os.path.isfile(os.path.join(root, name))
    )


def is_validation(file_name: str) -> bool:
    """Whether `file_name` (stdlib-relative) is in the validation split; by SHA-256, as `hash()`
    is salted per process."""
    digest = hashlib.sha256(file_name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % _VALIDATION_BUCKETS == 0


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
        files = stdlib_files()
        return {
            "train": self._generate_examples(files, validation=False),
            "validation": self._generate_examples(files, validation=True),
        }

    def _generate_examples(
        self, files: list[str], validation: bool
    ) -> Iterator[tuple[int, dict[str, str]]]:
        root = stdlib_dir()
        for key, name in enumerate(files):
            if is_validation(name) != validation:
                continue
            with open(os.path.join(root, name), "rb") as source:
                text = source.read().decode("utf-8", errors="replace")
            yield key, {"path": name, "text": text}

"""`mpt_python_source`: the running Python's standard library as a text dataset.

Made for byte-level language modelling without any download: the examples are
the top-level `*.py` files of the standard library directory of the Python that
prepares the dataset (about 170 files, under 5 MB for CPython 3.11), so the
content depends on that Python's version, which the description records.
"""

import hashlib
import os
import sys
from collections.abc import Iterator

import tensorflow_datasets as tfds

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
    """Returns the directory of the running Python's standard library."""
    return os.path.dirname(os.__file__)


def stdlib_files() -> list[str]:
    """Returns the top-level `*.py` file names of the standard library, sorted."""
    root = stdlib_dir()
    return sorted(
        name
        for name in os.listdir(root)
        if name.endswith(".py") and os.path.isfile(os.path.join(root, name))
    )


def is_validation(file_name: str) -> bool:
    """Whether `file_name` belongs to the validation split.

    Uses SHA-256 rather than `hash()`, which is salted per process.

    Args:
        file_name: A file name relative to the standard library directory.

    Returns:
        True for validation, False for train.
    """
    digest = hashlib.sha256(file_name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % _VALIDATION_BUCKETS == 0


class MptPythonSource(tfds.core.GeneratorBasedBuilder):
    """The standard library's top-level source files, split by file name."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        # Not dataset_info_from_configs(): a README.md next to this module would
        # silently replace the description.
        return tfds.core.DatasetInfo(
            builder=self,
            description=_DESCRIPTION,
            features=tfds.features.FeaturesDict(
                {"path": tfds.features.Text(), "text": tfds.features.Text()}
            ),
            homepage=_HOMEPAGE,
            # Keys are positions in file-name order: keep that order.
            disable_shuffling=True,
        )

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

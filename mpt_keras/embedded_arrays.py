"""The embedded datasets as plain arrays, without TFDS: the one home of their content.

The TFDS builders (`digits.py`, `python_source.py`) store exactly these examples; on
Keras' JAX backend, where TensorFlow may be absent, runs read them from here. Splits are
`train` and `validation`, whole (TFDS slices such as `train[:10%]` need TFDS).
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from mpt_keras.checks import check_choice, check_number
from mpt_keras.errors import UserInputError

# Each embedded dataset and its reference shape: images and labels, or text.
EMBEDDED_DATASETS = {"mpt_digits": "image", "mpt_python_source": "text"}

SPLITS = ("train", "validation")

VOCAB_SIZE = 256
"""Byte-level tokens: every token is one byte of UTF-8 text."""

_MAX_COUNT = 16
_VALIDATION_EVERY = 5
_VALIDATION_BUCKETS = 10


def digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    """`mpt_digits`' `split`: uint8 images [N, 8, 8, 1] and int64 labels [N], in
    scikit-learn order; example i is in `validation` iff i % 5 == 0."""
    from sklearn import datasets as sklearn_datasets  # Only where the digits are read.

    check_choice("split", split, SPLITS)
    loaded = sklearn_datasets.load_digits()
    # scikit-learn's 0..16 pixel counts to uint8 0..255: round(counts * 255 / 16).
    images = np.rint(loaded.images * 255.0 / _MAX_COUNT).astype(np.uint8)[..., np.newaxis]
    labels = loaded.target.astype(np.int64)
    chosen = digit_indices(split, len(labels))
    return images[chosen], labels[chosen]


def digit_indices(split: str, count: int = 1797) -> np.ndarray:
    """The scikit-learn indices of `split`'s digits, in order (`count`: all the digits)."""
    check_choice("split", split, SPLITS)
    indices = np.arange(count)
    in_validation = indices % _VALIDATION_EVERY == 0
    return indices[in_validation if split == "validation" else ~in_validation]


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


def python_source(split: str) -> list[tuple[int, str, str]]:
    """`mpt_python_source`' `split`: `(key, path, text)` per top-level stdlib file, in file-name
    order; `text` decoded as UTF-8, invalid bytes replaced."""
    check_choice("split", split, SPLITS)
    root = stdlib_dir()
    examples = []
    for key, name in enumerate(stdlib_files()):
        if is_validation(name) != (split == "validation"):
            continue
        with open(os.path.join(root, name), "rb") as source:
            examples.append((key, name, source.read().decode("utf-8", errors="replace")))
    return examples


def text_windows(
    texts: list[bytes], sequence_length: int, name: str, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level next-token windows `(inputs, targets)`, int32 [windows, sequence_length].

    The UTF-8 `texts`, joined by b"\\n", cut into non-overlapping windows of
    `sequence_length + 1` tokens; a partial tail is dropped. `name`, `split`: for messages.
    """
    check_number("sequence_length", sequence_length, minimum=1, integer=True)
    stream = b"\n".join(texts)
    window = sequence_length + 1
    num_windows = len(stream) // window
    if num_windows == 0:
        raise UserInputError(
            f"Split {split!r} of dataset {name!r} has {len(stream)} bytes, fewer "
            f"than one window of sequence_length + 1 = {window}. Allowed: a "
            f"sequence_length below {len(stream)}."
        )
    tokens = np.frombuffer(stream, dtype=np.uint8, count=num_windows * window)
    windows = tokens.astype(np.int32).reshape(num_windows, window)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


PYTHON_VERSION = "{}.{}".format(*sys.version_info[:2])

"""TFDS's private progress-bar switch, read so that hiding the bars can restore it.

TFDS offers a setter (`tfds.display_progress_bar`) but no getter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow_datasets as tfds


@contextlib.contextmanager
def progress_bar_hidden() -> Iterator[None]:
    """No TFDS progress bars inside; `tfds.core.utils.tqdm_utils._active` restored (TFDS 4.9.10)."""
    shown = tfds.core.utils.tqdm_utils._active
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(shown)

"""Tests of mpt_keras.compat.tfds_progress: TFDS's private progress-bar switch.

Each fails naming the TFDS version.
"""

import pytest
import tensorflow_datasets as tfds

from mpt_keras.compat import tfds_progress

VERSION = f"TFDS {tfds.__version__}"


@pytest.mark.parametrize("shown", [True, False])
def test_progress_bars_are_hidden_inside_and_as_before_after(shown):
    original = tfds.core.utils.tqdm_utils._active
    tfds.display_progress_bar(shown)
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with tfds_progress.progress_bar_hidden():
                assert tfds.core.utils.tqdm_utils._active is False, (
                    f"{VERSION}: tqdm_utils._active changed"
                )
                raise RuntimeError("inside")
        assert tfds.core.utils.tqdm_utils._active is shown
    finally:
        tfds.display_progress_bar(original)

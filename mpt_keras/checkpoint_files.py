"""Where a run's checkpoints lie, and which one a rerun resumes from, on every backend.

`backend/tensorflow/checkpoints.py` (tf.train files) and `reliability/array_checkpoints.py`
(NumPy files) both keep `model_dir/checkpoints/step-<N>...`; a rerun restores the newest one
it can read, warns for each torn or foreign one it passes over, and refuses in one line when
none can be read (moving the directory away starts over).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence

from mpt_keras.errors import UserInputError, first_line

CHECKPOINT_SUBDIR = "checkpoints"
PREFIX = "step"  # A checkpoint's name: `step-<N>`, then its files' suffixes.
_LOGGER = logging.getLogger(__name__)


def newest_first(directory: str, suffix: str) -> list[str]:
    """`directory/step-<N>` for each file `step-<N><suffix>` in `directory`, newest first.

    From the files, not a state file that may miss one; [] without the directory.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    pattern = re.compile(rf"^{PREFIX}-(\d+){re.escape(suffix)}$")
    steps = sorted((int(m.group(1)) for m in map(pattern.match, names) if m), reverse=True)
    return [os.path.join(directory, f"{PREFIX}-{step}") for step in steps]


def restore_newest(
    directory: str,
    candidates: Sequence[str],
    restore: Callable[[str], int],
    unreadable: tuple[type[BaseException], ...],
) -> int:
    """The steps done of the first of `candidates` (newest first) that `restore` reads; 0
    for none.

    `restore(candidate)` restores it and returns its steps done, or raises one of
    `unreadable`: that candidate is passed over with a warning. `UserInputError` naming
    `directory` if there were candidates and none could be read.
    """
    problems = []
    for candidate in candidates:
        try:
            step = restore(candidate)
        except unreadable as error:
            problems.append(first_line(error) or type(error).__name__)
            _LOGGER.warning(
                "Checkpoint %s cannot be restored (%s): trying the one before it.",
                candidate,
                problems[-1],
            )
            continue
        _LOGGER.info("Resumed from %s at step %d.", candidate, step)
        return step
    if candidates:
        raise UserInputError(
            f"{directory}: none of its {len(candidates)} checkpoints can be restored "
            f"(the latest: {problems[0]}); move the directory away to start over"
        )
    return 0

"""TensorFlow's error messages cut to what a one-line message can quote.

They run on with node and kernel details; the first sentence says what failed.
"""

from __future__ import annotations

import re
from typing import Any

MAX_REASON_CHARACTERS = 160


def first_sentence(reason: Any) -> str:
    """The first sentence of `reason` (an error or text), at most `MAX_REASON_CHARACTERS`."""
    text = " ".join(str(reason).split())
    return re.split(r"(?<=\.) ", text, maxsplit=1)[0][:MAX_REASON_CHARACTERS] or "no details"

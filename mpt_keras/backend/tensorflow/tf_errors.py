"""TensorFlow's error messages cut to their first sentence (what failed; node and kernel
details follow), for one-line messages."""

from __future__ import annotations

import re
from typing import Any

MAX_REASON_CHARACTERS = 160


def first_sentence(reason: Any) -> str:
    """`reason`'s (error or text) first sentence, at most `MAX_REASON_CHARACTERS`."""
    text = " ".join(str(reason).split())
    return re.split(r"(?<=\.) ", text, maxsplit=1)[0][:MAX_REASON_CHARACTERS] or "no details"

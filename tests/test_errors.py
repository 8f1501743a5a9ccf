"""mpt_keras/errors.py: the one-line forms an error takes inside a message of ours."""

from __future__ import annotations

import pytest

from mpt_keras.errors import first_line, printable


class _KeptMessage(Exception):
    """As TensorFlow's errors: `str()` adds context, `message` is the error's own."""

    def __init__(self, message: str):
        super().__init__(f"{message}\n\tcontext the message does not need")
        self.message = message


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (ValueError("\n  first line  \nsecond line"), "first line"),
        (_KeptMessage("its own message"), "its own message"),
        (ValueError(), ""),
        (OSError("   \n "), ""),
    ],
)
def test_first_line_is_the_messages_first_line_or_empty(error, line):
    assert first_line(error) == line


def test_printable_escapes_control_characters_once():
    escaped = printable("a\tb\nc\\d\ud800")
    assert escaped == "a\\tb\\nc\\d\\ud800"
    assert printable(escaped) == escaped

"""The toolkit's own errors: bad user input, and a lost peer worker.

Launchers print either as a single line and exit with a status of its own (see
`trainers.cli`); any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
import traceback


class UserInputError(ValueError):
    """Bad input from the user: a flag, a config or manifest file, or data.

    The message names what was wrong (the flag, file, key or value received) and what is
    allowed instead, in one line: unprintable characters (of a key, path or regex quoted in
    it) are escaped (`printable`).
    """

    def __init__(self, message: str):
        super().__init__(printable(message))


class RunStoppedError(UserInputError):
    """A guard stopped training: too much bad data, or a divergence it cannot mend.

    Reported like bad input (one line, exit status 2): the data or the config must change
    before a rerun. The saved checkpoints are kept.
    """


class PeerFailedError(RuntimeError):
    """A multi-worker run lost a peer worker (crashed, killed or preempted), and TensorFlow
    aborted this worker's collectives. The input is fine and the saved checkpoints complete:
    rerunning every worker with the same `model_dir` resumes. The one-line message names the
    peer, what TensorFlow reported and the `model_dir`.
    """


def printable(text: str) -> str:
    """`text` with each unprintable character escaped as in Python literals.

    Line breaks, tabs, other control characters and lone surrogates become `\\n`, `\\t`,
    `\\x85`, `\\ud800`; printable text, backslashes included, is unchanged (so twice is once).
    """
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


# ANSI escape sequences: Keras sets an error of a layer's call in bold.
_TERMINAL_FORMATTING = re.compile(r"\x1b\[[0-9;]*m")


def describe_error(error: BaseException) -> str:
    """`Type: message (file, line N)`: an error of the user's code, in one line, where it was
    raised (a syntax error's own position)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{type(error).__name__}: {error.msg} ({error.filename}, line {error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    # The innermost frame outside the import machinery is where it was raised.
    user_frames = [frame for frame in frames if "importlib" not in frame.filename]
    where = f" ({user_frames[-1].filename}, line {user_frames[-1].lineno})" if user_frames else ""
    return f"{type(error).__name__}: {_one_line(str(error))}{where}"


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message (TensorFlow's own `message` where it keeps one);
    empty if it has none. For a reason quoted inside a message of ours."""
    text = str(getattr(error, "message", None) or error).strip()
    return text.splitlines()[0].strip() if text else ""


def _one_line(message: str) -> str:
    """`message`'s lines joined, without the arguments Keras lists after a layer's error, or
    its terminal formatting."""
    message = _TERMINAL_FORMATTING.sub("", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = next(
        (i for i, line in enumerate(lines) if line.startswith("Arguments received by")), None
    )
    return " ".join(lines[:kept] if kept else lines)

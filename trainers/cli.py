"""What every launcher shares: quiet TensorFlow, one-line errors, exit codes.

A user error (a bad flag, config, manifest or dataset) ends the program with
exit status 2 and a single line on stderr, `<program>: error: <message>`,
naming what was wrong and what is allowed; never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from absl import app, flags
from absl import logging as absl_logging

USAGE_ERROR = 2


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Sends file descriptor 2 to /dev/null, for the duration of a block.

    TensorFlow's C++ start-up lines (oneDNN, CUDA probing) are written before
    its log level applies, straight to the descriptor.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Later C++ info lines are filtered by the level; TF_CPP_MIN_LOG_LEVEL=0 shows them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
if os.environ.get("MPT_SHOW_TF_STARTUP") != "1":
    with _native_stderr_silenced():
        import tensorflow as tf

        # Probing the physical devices is where the CUDA start-up lines come from;
        # it does not initialise the runtime, so logical devices stay configurable.
        tf.config.list_physical_devices()

from mpt_keras.errors import UserInputError  # noqa: E402


def run(main: Callable[[Sequence[str]], None]) -> None:
    """Runs `main` under absl, turning user errors into one line and status 2."""
    program = os.path.basename(sys.argv[0]).removesuffix(".py")
    if program in ("__main__", "-m"):
        program = main.__module__.removeprefix("trainers.")

    def fail(message: str) -> None:
        print(f"{program}: error: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR)

    def parse_flags(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            fail(str(error))

    def main_with_errors(argv: Sequence[str]) -> None:
        if not flags.FLAGS["verbosity"].present:
            # The toolkit's own INFO lines; TFDS (which logs through absl) only
            # its errors. --verbosity=0 shows everything.
            absl_logging.set_verbosity(absl_logging.ERROR)
            logging.getLogger("mpt_keras").setLevel(logging.INFO)
        if len(argv) > 1:
            fail(f"unexpected positional arguments {' '.join(argv[1:])}; all options are --flags")
        try:
            main(argv)
        except UserInputError as error:
            fail(str(error))

    app.run(main_with_errors, flags_parser=parse_flags)

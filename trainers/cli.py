"""What every launcher shares: one-line errors, exit codes, concise logs.

A user error (a bad flag, config, manifest or dataset) ends the program with
exit status 2 and a single line on stderr, `<program>: error: <message>`,
naming what was wrong and what is allowed; never a traceback. A multi-worker
run that loses a peer worker ends the same way with exit status 75 (EX_TEMPFAIL
of sysexits.h: a temporary failure, retrying may succeed), naming the peer and
the `model_dir` that a rerun of all workers resumes from.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from absl import app, flags
from absl import logging as absl_logging

from mpt_keras.errors import PeerFailedError, UserInputError, printable

USAGE_ERROR = 2
PEER_FAILED = 75


def run(main: Callable[[Sequence[str]], None], program: str) -> None:
    """Runs `main` under absl, turning the toolkit's errors into one line each.

    A `UserInputError` exits with status 2, a `PeerFailedError` with 75.

    Args:
        main: The launcher's main, called with the arguments left after flags.
        program: The launcher's name in messages, e.g. `mpt-train`.
    """

    def fail(message: str, status: int = USAGE_ERROR) -> None:
        # absl's flag errors quote the value as given, line breaks included.
        print(f"{program}: error: {printable(message)}", file=sys.stderr)
        sys.exit(status)

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
        except PeerFailedError as error:
            fail(str(error), PEER_FAILED)

    app.run(main_with_errors, flags_parser=parse_flags)

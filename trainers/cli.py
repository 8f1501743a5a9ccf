"""What every launcher shares: one-line errors, exit codes, concise logs.

A user error (a bad flag, config, manifest or dataset) ends the program with
exit status 2 and a single line on stderr, `<program>: error: <message>`,
naming what was wrong and what is allowed; never a traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from absl import app, flags
from absl import logging as absl_logging

from mpt_keras.errors import UserInputError

USAGE_ERROR = 2


def run(main: Callable[[Sequence[str]], None], program: str) -> None:
    """Runs `main` under absl, turning user errors into one line and status 2.

    Args:
        main: The launcher's main, called with the arguments left after flags.
        program: The launcher's name in messages, e.g. `mpt-train`.
    """

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

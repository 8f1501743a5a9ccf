"""What every launcher shares: one-line errors, exit codes, concise logs.

A user error ends the program with exit status 2 and one line on stderr,
`<program>: error: <message>`, never a traceback. A lost peer worker ends it the
same way with status 75 (EX_TEMPFAIL: rerunning all workers resumes).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

from absl import app, flags
from absl import logging as absl_logging

from mpt_keras.errors import PeerFailedError, UserInputError, printable

USAGE_ERROR = 2
PEER_FAILED = 75
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort")


def run(
    main: Callable[[Sequence[str]], None],
    program: str,
    help_groups: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Runs `main` under absl, a `UserInputError` exiting 2 and a `PeerFailedError` 75.

    Args:
        program: The launcher's name in messages, e.g. `mpt-train`.
        help_groups: Titles and the flag names under each, in the order
            `--help` shows them; the launcher's other flags go under "Other".
    """
    if any(argument in HELP_FLAGS for argument in sys.argv[1:]):
        print(help_text(main.__module__, program, help_groups or {}), end="")
        sys.exit(0)

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
            # Our INFO lines; TFDS (logging through absl) only its errors.
            absl_logging.set_verbosity(absl_logging.ERROR)
            logging.getLogger("mpt_keras").setLevel(logging.INFO)
        if len(argv) > 1:
            fail(f"unexpected positional arguments {' '.join(argv[1:])}; all options are --flags")
        peer_failure = None
        try:
            main(argv)
        except UserInputError as error:
            fail(str(error))
        except PeerFailedError as error:
            peer_failure = str(error)
        if peer_failure is not None:
            # TensorFlow's aborted all-reduce leaves a thread pool in the error's frames:
            # collected now, its pipes still open, not at exit, where it prints a traceback.
            gc.collect()
            fail(peer_failure, PEER_FAILED)

    app.run(main_with_errors, flags_parser=parse_flags)


def help_text(module_name: str, program: str, groups: Mapping[str, Sequence[str]]) -> str:
    """The launcher's docstring and its own flags, grouped, each with its default.

    (absl's `--help` shows the main module's flags: for a console script, none of ours.)
    """
    defined = {flag.name: flag for flag in flags.FLAGS.get_flags_for_module(module_name)}
    grouped = [(title, [defined[name] for name in names]) for title, names in groups.items()]
    listed = {name for names in groups.values() for name in names}
    others = [flag for name, flag in sorted(defined.items()) if name not in listed]
    if others:
        grouped.append(("Other", others))
    lines = [inspect.getdoc(sys.modules[module_name]) or program, ""]
    for title, group in grouped:
        lines.append(f"{title}:")
        for flag in group:
            if _is_required(flag):
                default = "required"
            elif flag.default is None:
                default = "default: unset"
            else:
                default = f"default: {flag.default_as_str}"
            lines.append(f"  --{flag.name}: {flag.help} ({default})")
        lines.append("")
    lines.append(f"{program} --helpfull also lists absl's own flags (logging, ...).")
    return "\n".join(lines) + "\n"


def _is_required(flag: flags.Flag) -> bool:
    """Whether `flags.DEFINE_*(..., required=True)` made `flag` required."""
    return any(
        "must have a value other than None" in getattr(validator, "message", "")
        for validator in flag.validators
    )


def import_tensorflow() -> None:
    """Imports Keras on its backend, and TensorFlow where Keras brings it, with TensorFlow's
    native start-up lines silenced; see `trainers`. On Keras' JAX backend TensorFlow may be
    absent, and is not needed."""
    # TF_CPP_MIN_LOG_LEVEL=0 shows the later C++ info lines.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # Else only oneDNN's allocator (AVX512 CPUs) keeps statistics, of allocations >= 256 KiB.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    try:
        if "keras" in sys.modules or os.environ.get("MPT_SHOW_TF_STARTUP") == "1":
            import keras  # noqa: F401  (already loaded, or loaded with its lines shown)

            return
        with _native_stderr_silenced():
            import keras

            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                # The CUDA start-up lines; logical devices stay configurable after it.
                tf.config.list_physical_devices()
    except ModuleNotFoundError as missing:  # A machine without TensorFlow, its backend not set.
        backend = os.environ.get("KERAS_BACKEND") or "its default or ~/.keras/keras.json's"
        raise UserInputError(
            f"Keras cannot load its backend ({backend}) here: no module named "
            f"'{missing.name}'. Allowed: --backend=jax or --backend=tensorflow, whichever is "
            "installed"
        ) from None


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Sends file descriptor 2, where TensorFlow's C++ start-up lines go, to /dev/null."""
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

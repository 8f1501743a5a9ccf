"""The one error type the toolkit raises for bad user input.

Launchers print a `UserInputError` as a single line and exit with status 2; any
other exception is a bug and keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input from the user: a flag, a config or manifest file, or data.

    The message names what was wrong (the flag, file, key or value received) and
    what is allowed instead, in one line.
    """

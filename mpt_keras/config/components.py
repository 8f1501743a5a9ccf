"""A component's user code: `"factory": "package.module:attribute"` imported (from the working
directory or `PYTHONPATH`) and its `options` bound to its signature before anything runs, so a
bad option or module costs no run. Imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from mpt_keras import checks
from mpt_keras.errors import UserInputError, describe_error

FACTORY_SYNTAX = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""`package.module:attribute`, the attribute possibly dotted."""

DATA_DIMENSIONS = ("input_shape", "num_classes", "vocab_size", "sequence_length")
"""What the data decides about a model, passed to a factory that takes it."""


@dataclasses.dataclass(frozen=True)
class BoundFactory:
    """A user callable with its options bound; `key` names it (`model.factory`), `parameters`
    it accepts (`None`: `**kwargs`), `required` ones without a default `options` leaves open.
    """

    reference: str
    function: Callable[..., Any]
    options: Mapping[str, Any]
    key: str
    parameters: frozenset[str] | None
    required: frozenset[str]

    def accepts(self, name: str) -> bool:
        """Whether the callable takes keyword argument `name`."""
        return self.parameters is None or name in self.parameters

    def __call__(self, **provided: Any) -> Any:
        """Calls it with its options and the non-None `provided` values it takes (a required
        one still missing: `UserInputError`)."""
        extra = {
            name: value
            for name, value in provided.items()
            if value is not None and name not in self.options and name in (self.parameters or ())
        }
        missing = sorted(self.required - set(extra))
        if missing:
            raise UserInputError(
                f"{self.key} {self.reference}: parameter '{missing[0]}' has no value: the "
                f"data does not decide it. Allowed: give it in {_options_key(self.key)}"
            )
        return self.function(**self.options, **extra)


def import_modules(modules: Iterable[str], key: str = "imports") -> None:
    """Imports the config's `imports` (custom layers register); `UserInputError` names the
    module and the user's error."""
    for index, module in enumerate(modules):
        _import(module, f"{key}[{index}]")


def check_factory_syntax(reference: Any, key: str) -> None:
    """Refuses a factory reference at `key` not of form `package.module:attribute`."""
    if not isinstance(reference, str) or not FACTORY_SYNTAX.fullmatch(reference):
        raise checks.refusal(
            f"key '{key}'", checks.as_json(reference), "'package.module:attribute'"
        )


def resolve_factory(reference: str, key: str) -> Callable[..., Any]:
    """Imports and returns `package.module:attribute` (named by config key `key`).

    `UserInputError`: bad syntax, a failing import, a missing or uncallable attribute.
    """
    check_factory_syntax(reference, key)
    module_name, _, attribute = reference.partition(":")
    value: Any = _import(module_name, key)
    for part in attribute.split("."):
        if not hasattr(value, part):
            public = sorted(name for name in dir(value) if not name.startswith("_"))
            raise UserInputError(
                f"key '{key}': {reference} has no attribute {part!r}. "
                f"Allowed: {', '.join(public[:20]) or 'nothing public'}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise UserInputError(
            f"key '{key}': {reference} is a {type(value).__name__}, not callable. "
            "Allowed: a function or class"
        )
    return value


def bind_factory(
    reference: str,
    options: Mapping[str, Any],
    key: str,
    provided: Collection[str] = (),
) -> BoundFactory:
    """Resolves `reference` and binds `options` to its signature.

    `provided`: names the run passes where taken (the data's dimensions). `UserInputError`: as
    `resolve_factory`, or an option not taken or a required one open (listing what it takes).
    """
    function = resolve_factory(reference, key)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        # A builtin without a signature: the call decides.
        return BoundFactory(reference, function, dict(options), key, None, frozenset())
    parameters = {
        name: parameter
        for name, parameter in signature.parameters.items()
        if parameter.kind
        in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_any = any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD
        for parameter in signature.parameters.values()
    )
    accepted = ", ".join(parameters) or "no keyword arguments"
    unknown = sorted(set(options) - set(parameters))
    if unknown and not takes_any:
        raise UserInputError(
            f"unknown option '{_options_key(key)}.{unknown[0]}' for {reference}. "
            f"Allowed: {accepted}"
        )
    required = {
        name
        for name, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty and name not in options
    }
    missing = sorted(required - set(provided))
    if missing:
        raise UserInputError(
            f"missing option '{_options_key(key)}.{missing[0]}' for {reference}: it has no "
            f"default. Accepted: {accepted}"
        )
    return BoundFactory(
        reference,
        function,
        dict(options),
        key,
        None if takes_any else frozenset(parameters),
        frozenset(required),
    )


def _options_key(key: str) -> str:
    return key.rpartition(".")[0] + ".options" if "." in key else "options"


def _import(module_name: str, key: str) -> Any:
    """Imports a user's module, from the working directory too (as `python -m`)."""
    working_directory = os.getcwd()
    if working_directory not in sys.path and "" not in sys.path:
        sys.path.insert(0, working_directory)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise UserInputError(
                f"key '{key}': no module named {error.name!r}. Allowed: a module in the "
                f"working directory ({working_directory}) or on PYTHONPATH"
            ) from None
        raise UserInputError(
            f"key '{key}': importing {module_name} failed: {describe_error(error)}"
        ) from None
    except Exception as error:  # The user's code: any error is theirs to see.
        raise UserInputError(
            f"key '{key}': importing {module_name} failed: {describe_error(error)}"
        ) from None

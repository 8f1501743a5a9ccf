"""Tests of config.components: factory references resolved and bound before anything runs."""

import sys
import textwrap

import pytest

from mpt_keras.config import components
from mpt_keras.errors import UserInputError


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module of the user's into a fresh working directory; returns a writer."""
    monkeypatch.chdir(tmp_path)
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return str(tmp_path / f"{name}.py")

    yield write
    for name in written:
        sys.modules.pop(name, None)


FACTORIES = """
    def build(input_shape, num_classes, width=8, *, depth=2):
        return ("built", tuple(input_shape), num_classes, width, depth)

    def anything(**kwargs):
        return kwargs

    value = 3
"""


def test_options_are_bound_and_the_data_fills_in_only_what_the_factory_takes(user_module):
    user_module("my_models", FACTORIES)
    factory = components.bind_factory(
        "my_models:build", {"width": 4}, "model.factory", provided=components.DATA_DIMENSIONS
    )
    built = factory(input_shape=[8, 8, 1], num_classes=10, vocab_size=256, sequence_length=None)
    assert built == ("built", (8, 8, 1), 10, 4, 2)
    assert factory.accepts("width") and not factory.accepts("vocab_size")


def test_an_option_wins_over_the_dimension_the_data_decides(user_module):
    user_module("my_models", FACTORIES)
    factory = components.bind_factory(
        "my_models:build", {"num_classes": 3}, "model.factory", provided=components.DATA_DIMENSIONS
    )
    assert factory(input_shape=(2,), num_classes=10)[2] == 3


def test_a_factory_taking_any_keyword_gets_its_options(user_module):
    user_module("my_models", FACTORIES)
    factory = components.bind_factory("my_models:anything", {"a": 1}, "data.factory")
    assert factory() == {"a": 1}


@pytest.mark.parametrize(
    "reference, options, provided, message",
    [
        (
            "my_models:build",
            {"widht": 4},
            components.DATA_DIMENSIONS,
            "unknown option 'model.options.widht' for my_models:build. "
            "Allowed: input_shape, num_classes, width, depth",
        ),
        (
            "my_models:build",
            {},
            (),
            "missing option 'model.options.input_shape' for my_models:build: it has no default. "
            "Accepted: input_shape, num_classes, width, depth",
        ),
        (
            "my_models:nothing",
            {},
            (),
            "key 'model.factory': my_models:nothing has no attribute 'nothing'. "
            "Allowed: anything, build, value",
        ),
        (
            "my_models:value",
            {},
            (),
            "key 'model.factory': my_models:value is a int, not callable. "
            "Allowed: a function or class",
        ),
        (
            "no_such_module:build",
            {},
            (),
            "key 'model.factory': no module named 'no_such_module'. Allowed: a module in the "
            "working directory ({cwd}) or on PYTHONPATH",
        ),
        (
            "my_models",
            {},
            (),
            "key 'model.factory': received \"my_models\". Allowed: 'package.module:attribute'",
        ),
    ],
)
def test_bad_references_and_options_are_one_line_errors(
    user_module, tmp_path, reference, options, provided, message
):
    user_module("my_models", FACTORIES)
    with pytest.raises(UserInputError) as raised:
        components.bind_factory(reference, options, "model.factory", provided=provided)
    assert str(raised.value) == message.format(cwd=tmp_path)


def test_a_required_parameter_the_data_leaves_open_is_named_at_the_call(user_module):
    user_module("my_models", FACTORIES)
    factory = components.bind_factory(
        "my_models:build", {}, "model.factory", provided=components.DATA_DIMENSIONS
    )
    with pytest.raises(UserInputError) as raised:
        factory(input_shape=(2,), num_classes=None)
    assert str(raised.value) == (
        "model.factory my_models:build: parameter 'num_classes' has no value: the data does "
        "not decide it. Allowed: give it in model.options"
    )


def test_a_module_that_fails_to_import_is_reported_with_its_own_error_and_line(user_module):
    path = user_module(
        "broken_models",
        """
        import math

        RATE = 1 / 0
        """,
    )
    with pytest.raises(UserInputError) as raised:
        components.bind_factory("broken_models:build", {}, "model.factory")
    assert str(raised.value) == (
        "key 'model.factory': importing broken_models failed: "
        f"ZeroDivisionError: division by zero ({path}, line 4)"
    )


def test_a_syntax_error_names_the_file_and_line(user_module):
    path = user_module("typo_models", "def build(:\n    pass\n")
    with pytest.raises(UserInputError) as raised:
        components.import_modules(["typo_models"])
    assert str(raised.value) == (
        "key 'imports[0]': importing typo_models failed: "
        f"SyntaxError: invalid syntax ({path}, line 1)"
    )


def test_a_missing_module_inside_the_users_module_is_the_users_error(user_module):
    path = user_module("needs_more", "import not_installed_anywhere\n")
    with pytest.raises(UserInputError) as raised:
        components.import_modules(["needs_more"])
    assert str(raised.value) == (
        "key 'imports[0]': importing needs_more failed: ModuleNotFoundError: No module named "
        f"'not_installed_anywhere' ({path}, line 1)"
    )

"""The house rules of docs/architecture.md that a reader cannot check at a glance.

- No module reaches another module's private (`_name`) names: neither
  `from mpt_keras.x import _y` nor `x._y` on an imported first-party module.
  A test file may reach the private names of the one module it is named after
  (`tests/test_runs_canary.py` and `mpt_keras/runs/canary.py`), to pin a helper that has
  no public caller worth driving.
- A module longer than `LONG_MODULE_LINES` says at its top why it is one
  module (a docstring paragraph that starts "Why one module").
- The docs name only tests that exist; the README stays a short tour.
"""

from __future__ import annotations

import ast
import itertools
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_PARTY = ("mpt_keras", "trainers", "benchmarks")
LONG_MODULE_LINES = 450


def _python_files(*folders: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), REPO)
        for folder in folders
        for root, _, names in os.walk(os.path.join(REPO, folder))
        for name in names
        if name.endswith(".py")
    )


def _module_name(path: str) -> str:
    parts = path[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_first_party(module: str) -> bool:
    return module.split(".")[0] in FIRST_PARTY


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of names and attributes; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_reaches(path: str, repo: str = REPO) -> list[str]:
    """Each `module._name` that the file at `path` (relative to `repo`) reaches.

    Its own private names aside.
    """
    with open(os.path.join(repo, path), encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    aliases: dict[str, str] = {}  # local name -> first-party module
    reaches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_first_party(alias.name):
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _is_first_party(node.module):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    reaches.append(f"{node.module}.{alias.name}")
                else:
                    # `from mpt_keras import keras_compat as compat`: a module, maybe.
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = _dotted(node.value)
            head, _, rest = (base or "").partition(".")
            if head in aliases:
                reaches.append(".".join(filter(None, (aliases[head], rest, node.attr))))
    own = _module_name(path)
    return sorted({reach for reach in reaches if reach.rsplit(".", 1)[0] != own})


def _tested_module(test_path: str) -> str:
    """The module whose private names `tests/test_<name>.py` may reach.

    `test_scaling_optimizer.py` tests `mpt_keras.scaling.optimizer`: each `_`
    of the name may stand for a folder's `/`.
    """
    parts = os.path.basename(test_path)[len("test_") : -len(".py")].split("_")
    for cuts in itertools.product(("_", "."), repeat=len(parts) - 1):
        dotted = parts[0] + "".join(cut + part for cut, part in zip(cuts, parts[1:]))
        path = os.path.join(REPO, "mpt_keras", *dotted.split("."))
        if os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__init__.py")):
            return f"mpt_keras.{dotted}"
    return f"benchmarks.{'_'.join(parts)}"


@pytest.mark.parametrize("path", _python_files(*FIRST_PARTY))
def test_no_module_reaches_another_modules_private_names(path):
    assert private_reaches(path) == []


@pytest.mark.parametrize("path", _python_files("tests"))
def test_a_test_file_reaches_only_its_own_modules_private_names(path):
    tested = _tested_module(path)
    assert [reach for reach in private_reaches(path) if not reach.startswith(tested + ".")] == []


@pytest.mark.parametrize("path", _python_files(*FIRST_PARTY))
def test_a_long_module_says_why_it_is_one_module(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as file:
        source = file.read()
    if source.count("\n") <= LONG_MODULE_LINES:
        return
    docstring = ast.get_docstring(ast.parse(source)) or ""
    assert any(paragraph.startswith("Why one module") for paragraph in docstring.split("\n\n")), (
        f"{path}: {source.count(chr(10))} lines and no 'Why one module' paragraph"
    )


def test_the_check_finds_each_kind_of_reach(tmp_path):
    (tmp_path / "mpt_keras").mkdir()
    (tmp_path / "mpt_keras" / "user.py").write_text(
        "from mpt_keras.runs.training import _fit, run_training\n"
        "from mpt_keras import compat\n"
        "import mpt_keras.execution.xla\n"
        "import benchmarks.suite as suite\n"
        "compat._tf_optimizer_class()\n"
        "mpt_keras.execution.xla._xla_function\n"
        "suite._op_profile\n"
        "run_training._private_but_not_a_module_name\n"
        "__name__, compat.__doc__\n"
    )
    assert private_reaches(os.path.join("mpt_keras", "user.py"), str(tmp_path)) == [
        "benchmarks.suite._op_profile",
        "mpt_keras.compat._tf_optimizer_class",
        "mpt_keras.execution.xla._xla_function",
        "mpt_keras.runs.training._fit",
        "mpt_keras.runs.training.run_training._private_but_not_a_module_name",
    ]


def _named_tests() -> list[tuple[str, str, str]]:
    """Each `tests/test_x.py::name` (or a following `::name` of the same file) in the docs."""
    named = []
    for page in ["README.md"] + sorted(
        os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
    ):
        with open(os.path.join(REPO, page), encoding="utf-8") as file:
            text = file.read()
        for line in text.splitlines():
            test_file = None
            for match in re.finditer(r"(tests/test_\w+\.py)?::(\w+)", line):
                test_file = match.group(1) or test_file
                if test_file:
                    named.append((page, test_file, match.group(2)))
    return named


@pytest.mark.parametrize(("page", "test_file", "name"), _named_tests())
def test_the_docs_name_only_tests_that_exist(page, test_file, name):
    with open(os.path.join(REPO, test_file), encoding="utf-8") as file:
        defined = {
            node.name
            for node in ast.walk(ast.parse(file.read()))
            if isinstance(node, ast.FunctionDef)
        }
    assert name in defined, f"{page} names {test_file}::{name}, which is not a test there"


def test_the_readme_is_a_short_tour():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as file:
        lines = file.read().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move details to docs/"
